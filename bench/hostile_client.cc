// hostile_client: a rank client that breaks the rules on purpose, for bench/chaos.py (issue
// 25). It speaks the real protocol over the real gRPC stack, as an attacker holding the
// job's `rank` role would:
//
//   non-reader     registers a rank (replicate: one decision per plan) and plans at the
//                  lookahead window's size forever without reading a reply; the daemon
//                  must fail it as not reading (its own or the daemon-wide bound) and cut
//                  the stream. Exit 0 once cut, 3 if still served after --seconds.
//   forge-resume   registers rank --rank of --job with a resume from an earlier
//                  coordinator, holding well-formed "decisions" it never received (per_layer
//                  for microbatches 0-7, seq 7,000,000 on, digests right), with the daemon's
//                  settings digest learnt from a registration of its own. Prints the daemon's
//                  answer; exit 0 when refused, 4 when accepted.
//
// Prints one line: mode, outcome, the daemon's status code and message.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>

#include "CLI/CLI.hpp"
#include "shardcoord/decide.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"

namespace v1 = shardcoord::v1;

namespace {

struct Args {
  std::string mode, address, job = "hostile", token;
  int rank = 0, world = 1, group = 1, lookahead = 64;
  double seconds = 30;
};

v1::RegisterRequest Registration(const Args& a) {
  v1::RegisterRequest r;
  r.set_job_id(a.job);
  r.set_wire_revision(shardcoord::kWireRevision);
  r.set_rank(a.rank);
  r.set_world_size(a.world);
  r.set_group_size(a.group);
  r.set_policy(v1::POLICY_REPLICATE);
  r.set_fallback(v1::FALLBACK_ROOT);
  r.set_wrap_outer_model(true);
  r.set_lookahead(a.lookahead);
  r.set_host("hostile");
  auto* m = r.add_modules();
  m->set_name("vision_tower");
  m->set_param_bytes(1 << 20);
  return r;
}

std::unique_ptr<grpc::ClientContext> Context(const Args& a) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(a.seconds * 1000) + 5000));
  if (!a.token.empty()) ctx->AddMetadata("authorization", "Bearer " + a.token);
  return ctx;
}

int NonReader(v1::Coordinator::Stub& stub, const Args& a) {
  auto ctx = Context(a);
  auto stream = stub.Session(ctx.get());
  v1::WorkerMessage reg;
  *reg.mutable_register_() = Registration(a);
  if (!stream->Write(reg)) {
    std::printf("non-reader refused-at-register\n");
    return 0;
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(a.seconds * 1000));
  int64_t step = 0;
  while (std::chrono::steady_clock::now() < until) {
    v1::WorkerMessage m;
    for (int i = 0; i < a.lookahead; ++i) {
      auto* p = m.mutable_bundle()->mutable_plans()->add_plans();
      p->mutable_key()->set_step(step++);
      (*p->mutable_calls())["vision_tower"] = 1;
    }
    if (!stream->Write(m)) {  // The daemon ended the stream.
      ctx->TryCancel();
      std::printf("non-reader cut after %lld plans\n", static_cast<long long>(step));
      return 0;
    }
  }
  ctx->TryCancel();
  std::printf("non-reader still-served after %lld plans in %.0f s\n", static_cast<long long>(step), a.seconds);
  return 3;
}

// Registers a rank of a job of its own, as anyone with the `rank` role may, to learn what a
// resume must match: the daemon's incarnation and settings digest.
std::optional<v1::RegisterResponse> Probe(v1::Coordinator::Stub& stub, const Args& a) {
  Args probe = a;
  probe.job = a.job + "-probe";
  probe.rank = 0;
  probe.world = probe.group = 1;
  auto ctx = Context(probe);
  auto stream = stub.Session(ctx.get());
  v1::WorkerMessage reg;
  *reg.mutable_register_() = Registration(probe);
  stream->Write(reg);
  v1::CoordinatorMessage in;
  std::optional<v1::RegisterResponse> out;
  if (stream->Read(&in) && in.has_registered()) out = in.registered();
  v1::WorkerMessage bye;
  bye.mutable_goodbye()->set_reason("probe done");
  stream->Write(bye);
  stream->WritesDone();
  while (stream->Read(&in)) {
  }
  stream->Finish();
  return out;
}

int ForgeResume(v1::Coordinator::Stub& stub, const Args& a) {
  const std::optional<v1::RegisterResponse> probe = Probe(stub, a);
  if (!probe) {
    std::printf("forge-resume no-probe (the daemon refused a registration of its own job)\n");
    return 0;
  }
  auto ctx = Context(a);
  auto stream = stub.Session(ctx.get());
  v1::RegisterRequest r = Registration(a);
  v1::ResumeState* s = r.mutable_resume();
  s->set_incarnation(probe->incarnation() > 1 ? probe->incarnation() - 1 : 0);  // "An earlier coordinator".
  s->set_group_epoch(0);
  s->mutable_previous()->set_config_digest(probe->config_digest());
  s->mutable_previous()->set_group(a.rank / a.group);
  s->mutable_previous()->set_policy(r.policy());
  s->mutable_previous()->set_fallback(r.fallback());
  s->mutable_previous()->set_lookahead(r.lookahead());
  // A real run id (of the probe's job): the forgery fails on its credential, not its form.
  s->mutable_previous()->set_run_id(probe->run_id());
  for (int mb = 0; mb < 8; ++mb) {
    auto* d = s->add_held();
    d->set_group(a.rank / a.group);
    d->mutable_key()->set_step(0);
    d->mutable_key()->set_microbatch(mb);
    d->set_seq(7000000 + mb);
    auto* md = d->add_modules();
    md->set_module("vision_tower");
    md->set_decision(v1::DECISION_PER_LAYER);
    md->set_reason(v1::REASON_UNIFORM);
    d->set_digest(shardcoord::DecisionDigest(shardcoord::FromProto(*d)));
  }
  v1::WorkerMessage reg;
  *reg.mutable_register_() = r;
  stream->Write(reg);
  stream->WritesDone();
  v1::CoordinatorMessage in;
  if (stream->Read(&in) && in.has_registered()) {
    ctx->TryCancel();
    std::printf("forge-resume ACCEPTED rank %d of job %s\n", a.rank, a.job.c_str());
    return 4;
  }
  const grpc::Status st = stream->Finish();  // The daemon's refusal.
  std::printf("forge-resume refused code=%d %s\n", static_cast<int>(st.error_code()), st.error_message().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"a rank client that breaks the rules on purpose (bench/chaos.py)"};
  app.add_option("mode", a.mode, "non-reader or forge-resume")->required()->check(CLI::IsMember({"non-reader", "forge-resume"}));
  app.add_option("--coordinator", a.address, "daemon address HOST:PORT")->required();
  app.add_option("--job", a.job, "job id");
  app.add_option("--rank", a.rank, "rank");
  app.add_option("--world", a.world, "world size");
  app.add_option("--group", a.group, "shard group size");
  app.add_option("--lookahead", a.lookahead, "lookahead window (plans per batch for non-reader)");
  app.add_option("--seconds", a.seconds, "how long to keep at it");
  app.add_option("--token", a.token, "bearer token");
  CLI11_PARSE(app, argc, argv);
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(a.address, grpc::InsecureChannelCredentials()));
  return a.mode == "non-reader" ? NonReader(*stub, a) : ForgeResume(*stub, a);
}
