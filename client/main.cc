// shardctl: the operator CLI of shardcoord.
//
//   shardctl [--coordinator ADDR] [--timeout-ms N] status|ranks|groups|decisions|comms|events [--json]
//   shardctl replay TRACE.jsonl [--coordinator ADDR] [--ranks 0,1] ...
//   shardctl plan TRACE.jsonl --manifest MANIFEST.json --cost COST.json [--group-size G] ...
//
// ADDR (HOST:PORT or [IPV6]:PORT) defaults to $SHARDCOORD_ADDR, then 127.0.0.1:7871. Every
// RPC has a deadline: an unreachable coordinator gives a one-line error, never a hang.
//
// Exit codes: 0 ok; 1 the coordinator answered but the request failed (a --job that names
// no job; in replay, a rank failed); 2 usage or bad input (an unknown command, a bad
// address or flag value, a bad trace, manifest or cost file) or the coordinator is
// unreachable; 3 (replay, verify) ranks of a group received different decisions.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cost_model.h"
#include "plan.h"
#include "replay.h"
#include "shardcoord/address.h"
#include "shardcoord/channel_credentials.h"
#include "watch.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"
#include "shardcoord/v1/coordinator.grpc.pb.h"
#include "shardcoord/version.h"
#include "trace.h"

namespace {

namespace v1 = shardcoord::v1;

constexpr char kDefaultAddress[] = "127.0.0.1:7871";
constexpr char kAddressEnv[] = "SHARDCOORD_ADDR";
constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;  // The coordinator answered, but the request failed.
constexpr int kExitUsage = 2;   // Usage or bad input.
constexpr int kExitUnreachable = 2;
static_assert(kExitUsage == shardcoord::client::kReplayBadInput);
// Longest --timeout-ms and the like: one day, as the coordinator's own *_ms settings.
constexpr int kMaxTimeoutMs = 24 * 60 * 60 * 1000;
constexpr int kMaxLimit = 1 << 20;  // --limit, --lookahead.

using shardcoord::AddressProblem;  // contract/address.h: the worker checks addresses the same way.

std::string ToJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions opts;
  opts.preserve_proto_field_names = true;
  opts.always_print_primitive_fields = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(m, &out, opts);
  return out;
}

std::string KeyText(const v1::MicrobatchKey& k) { return absl::StrFormat("(%d,%d)", k.step(), k.microbatch()); }

std::string FormatTime(int64_t unix_ms) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixMillis(unix_ms), absl::UTCTimeZone());
}

struct Client {
  std::string address;
  std::string token;  // `authorization: Bearer`, when the coordinator requires tokens.
  shardcoord::TlsFiles tls;
  int timeout_ms = 5000;
  std::unique_ptr<v1::Coordinator::Stub> stub;

  // False (and one line on stderr) when the TLS files cannot be used.
  bool Connect() {
    // A job of 65536 ranks lists more than gRPC's default 4 MiB.
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    auto creds = shardcoord::ChannelCredentialsFor(shardcoord::ResolveTls(tls), args);
    if (!creds.ok()) {
      std::cerr << "shardctl: " << creds.status().message() << "\n";
      return false;
    }
    stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel(address, *creds, args));
    return true;
  }

  // Runs one RPC with a deadline; the status, printing nothing.
  template <typename Req, typename Resp, typename Fn>
  grpc::Status Try(Fn fn, const Req& req, Resp* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    return (stub.get()->*fn)(&ctx, req, resp);
  }

  // Runs one RPC with a deadline; on failure prints one line and returns false.
  template <typename Req, typename Resp, typename Fn>
  bool Call(const char* what, Fn fn, const Req& req, Resp* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    grpc::Status s = (stub.get()->*fn)(&ctx, req, resp);
    if (!s.ok()) {
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
          s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        std::cerr << "shardctl: cannot reach coordinator at " << address << " (" << what
                  << ": " << s.error_message()
                  << "); is shardcoordd running? set --coordinator or SHARDCOORD_ADDR"
                  << (shardcoord::ResolveTls(tls).enabled()
                          ? "; check that it serves TLS with a certificate signed by the CA given (--tls-ca)"
                          : "; if it serves TLS, give its CA (--tls-ca or $SHARDCOORD_TLS_CA)")
                  << "\n";
      } else {
        std::cerr << "shardctl: " << what << " failed: " << s.error_message() << "\n";
      }
      return false;
    }
    return true;
  }
};

// A --job that names no job is a typo more often than not: every query says so the same
// way, with exit 1. The job is known when the query returned rows for it (the event journal
// keeps the events of a job that is gone), else when GetStatus names it. Returns kExitOk
// when there is no --job or the job is known, else the exit code.
int CheckJob(Client& c, const std::string& job, bool have_rows) {
  if (job.empty() || have_rows) return kExitOk;
  v1::StatusRequest req;
  req.set_job_id(job);
  v1::StatusResponse resp;
  if (!c.Call("GetStatus", &v1::Coordinator::Stub::GetStatus, req, &resp)) return kExitUnreachable;
  if (!resp.jobs().empty()) return kExitOk;
  std::cerr << "shardctl: coordinator at " << c.address << " has no job '" << job
            << "'; `shardctl status` lists the jobs\n";
  return kExitFailed;
}

// Width of a text column: its longest value (in bytes, as printf pads), at least `min` (the
// width before it grew), so that a long job id, host or name never shifts the columns after it.
template <typename Rows, typename Text>
int ColumnWidth(const Rows& rows, size_t min, Text text) {
  for (const auto& r : rows) min = std::max(min, text(r).size());
  return static_cast<int>(min);
}

using shardcoord::CountOf;
using shardcoord::Decision;
using shardcoord::DecisionName;
using shardcoord::kDecisions;

void PrintCounts(const v1::DecisionCounts& c) {
  std::cout << "  decisions:";
  for (Decision d : kDecisions) std::cout << "  " << DecisionName(d) << " " << CountOf(c, d);
  std::cout << "  (divergent " << c.divergent() << ")\n";
}

// The kinds' columns (decisions.def), upper-case names, each at least 7 wide.
std::string KindColumns(const std::function<std::string(Decision)>& cell) {
  std::string out;
  for (Decision d : kDecisions) {
    absl::StrAppend(&out, absl::StrFormat(" %*s", std::max<int>(7, static_cast<int>(strlen(DecisionName(d)))), cell(d)));
  }
  return out;
}

int CmdStatus(Client& c, const std::string& job, bool json) {
  v1::StatusRequest req;
  req.set_job_id(job);
  v1::StatusResponse resp;
  if (!c.Call("GetStatus", &v1::Coordinator::Stub::GetStatus, req, &resp)) return kExitUnreachable;
  if (int rc = CheckJob(c, job, !resp.jobs().empty()); rc != kExitOk) return rc;
  if (json) {
    std::cout << ToJson(resp) << "\n";
    return kExitOk;
  }
  std::cout << absl::StrFormat("coordinator %s  version %s  up %.1f s  incarnation %d  jobs %d%s\n", c.address,
                               resp.version(), resp.uptime_ms() / 1000.0, resp.incarnation(), resp.jobs_size(),
                               resp.recovering_groups() > 0
                                   ? absl::StrFormat("  RECOVERING: %d groups wait for ranks to resume",
                                                     resp.recovering_groups())
                                   : "");
  for (const auto& j : resp.jobs()) {
    std::cout << absl::StrFormat("job %s  world %d  group size %d  modules [%s]%s%s\n", j.job_id(), j.world_size(),
                                 j.group_size(), absl::StrJoin(j.modules(), ", "),
                                 j.trainable_modules().empty()
                                     ? ""
                                     : absl::StrCat("  trainable [", absl::StrJoin(j.trainable_modules(), ", "), "]"),
                                 j.modules().empty() ? "  (none: nothing is coordinated)" : "");
    std::cout << absl::StrFormat("  ranks: %d live, %d dead, %d left, %d unregistered\n",
                                 j.ranks_live(), j.ranks_dead(), j.ranks_left(), j.ranks_unregistered());
    std::cout << absl::StrFormat("  groups: %d healthy, %d failed, %d forming, %d finished, %d recovering\n",
                                 j.groups_healthy(), j.groups_failed(), j.groups_forming(),
                                 j.groups_finished(), j.groups_recovering());
    std::cout << absl::StrFormat("  plans received %d, microbatches decided %d\n", j.plans_received(),
                                 j.microbatches_decided());
    PrintCounts(j.counts());
    for (const auto& alert : j.comm_alerts()) std::cout << "  comm: " << alert << "\n";
  }
  return kExitOk;
}

int CmdRanks(Client& c, const std::string& job, bool json) {
  v1::ListRanksRequest req;
  req.set_job_id(job);
  v1::ListRanksResponse resp;
  if (!c.Call("ListRanks", &v1::Coordinator::Stub::ListRanks, req, &resp)) return kExitUnreachable;
  if (int rc = CheckJob(c, job, !resp.ranks().empty()); rc != kExitOk) return rc;
  if (json) {
    std::cout << ToJson(resp) << "\n";
    return kExitOk;
  }
  const int job_w = ColumnWidth(resp.ranks(), 10, [](const auto& r) -> const std::string& { return r.job_id(); });
  const int host_w = ColumnWidth(resp.ranks(), 16, [](const auto& r) -> const std::string& { return r.host(); });
  std::cout << absl::StrFormat("%-*s %5s %5s %-12s %-*s %8s %10s %12s %7s %8s %8s %12s  %s\n", job_w, "JOB", "RANK",
                               "GROUP", "STATE", host_w, "HOST", "PID", "HB_AGE_MS", "LAST_PLANNED",
                               "PENDING", "PLANS", "REJECTED", "PEAK_FROZEN", "REASON");
  for (const auto& r : resp.ranks()) {
    // Summed without overflow: the reports are the client's numbers (each >= 0, any size).
    int64_t peak = 0;
    bool overflow = false;
    for (const auto& m : r.memory()) {
      const int64_t b = std::max<int64_t>(0, m.peak_bytes());
      overflow = overflow || b > std::numeric_limits<int64_t>::max() - peak;
      peak = overflow ? std::numeric_limits<int64_t>::max() : peak + b;
    }
    std::cout << absl::StrFormat(
        "%-*s %5d %5d %-12s %-*s %8d %10d %12s %7d %8d %8d %12s  %s\n", job_w, r.job_id(), r.rank(), r.group(),
        shardcoord::StateName(r.state()), host_w, r.host(), r.pid(),
        r.last_heartbeat_age_ms(), r.has_last_planned() ? KeyText(r.last_planned()) : "-",
        r.pending_plans(), r.plans_received(), r.plans_rejected(),
        r.memory().empty() ? std::string("-") : overflow ? std::string("overflow") : absl::StrCat(peak),
        r.dead_reason());
  }
  return kExitOk;
}

int CmdGroups(Client& c, const std::string& job, bool json) {
  v1::ListGroupsRequest req;
  req.set_job_id(job);
  v1::ListGroupsResponse resp;
  if (!c.Call("ListGroups", &v1::Coordinator::Stub::ListGroups, req, &resp)) return kExitUnreachable;
  if (int rc = CheckJob(c, job, !resp.groups().empty()); rc != kExitOk) return rc;
  if (json) {
    std::cout << ToJson(resp) << "\n";
    return kExitOk;
  }
  std::cout << absl::StrFormat("%-10s %5s %-16s %-9s %5s %7s %7s", "JOB", "GROUP", "RANKS", "STATE", "EPOCH", "SEQ",
                               "PENDING")
            << KindColumns([](Decision d) { return absl::AsciiStrToUpper(DecisionName(d)); })
            << absl::StrFormat(" %9s  %s\n", "DIVERGENT", "REPLICATED / REASON");
  for (const auto& g : resp.groups()) {
    std::string note = absl::StrJoin(g.promoted_modules(), ",");
    if (!g.failure_reason().empty()) note += (note.empty() ? "" : " / ") + g.failure_reason();
    std::cout << absl::StrFormat("%-10s %5d %-16s %-9s %5d %7d %7d", g.job_id(), g.group(),
                                 absl::StrJoin(g.ranks(), ","), shardcoord::StateName(g.state()), g.epoch(),
                                 g.next_seq(), g.pending_microbatches())
              << KindColumns([&](Decision d) { return absl::StrCat(CountOf(g.counts(), d)); })
              << absl::StrFormat(" %9d  %s\n", g.counts().divergent(), note);
  }
  return kExitOk;
}

int CmdDecisions(Client& c, const std::string& job, int group, int limit, bool json) {
  v1::ListDecisionsRequest req;
  req.set_job_id(job);
  req.set_group(group);
  req.set_limit(limit);
  v1::ListDecisionsResponse resp;
  if (!c.Call("ListDecisions", &v1::Coordinator::Stub::ListDecisions, req, &resp)) return kExitUnreachable;
  if (int rc = CheckJob(c, job, !resp.decisions().empty()); rc != kExitOk) return rc;
  if (resp.truncated()) {
    std::cerr << "shardctl: the answer stopped at the coordinator's size limit; use --job, --group or a "
                 "smaller --limit for the rest\n";
  }
  if (json) {
    std::cout << ToJson(resp) << "\n";
    return kExitOk;
  }
  std::cout << absl::StrFormat("%-10s %5s %7s %12s %-28s %-10s %-16s %s\n", "JOB", "GROUP", "SEQ",
                               "MICROBATCH", "MODULE", "DECISION", "REASON", "DIGEST");
  for (const auto& e : resp.decisions()) {
    const auto& d = e.decision();
    for (const auto& m : d.modules()) {
      std::string kind = shardcoord::EnumText(v1::Decision_Name(m.decision()), "DECISION_");
      if (m.decision() == v1::DECISION_PADDED) absl::StrAppend(&kind, " x", m.calls());  // Its passes.
      std::cout << absl::StrFormat("%-10s %5d %7d %12s %-28s %-10s %-16s %016x\n", e.job_id(), d.group(),
                                   d.seq(), KeyText(d.key()), m.module(), kind,
                                   shardcoord::EnumText(v1::DecisionReason_Name(m.reason()), "REASON_"), d.digest());
    }
  }
  return kExitOk;
}

// --since: a duration back from now ("90m", "24h") or a time ("2026-12-01T08:00:00Z").
std::optional<int64_t> ParseSince(const std::string& text) {
  if (text.empty()) return 0;
  absl::Duration ago;
  if (absl::ParseDuration(text, &ago) && ago >= absl::ZeroDuration()) return absl::ToUnixMillis(absl::Now() - ago);
  absl::Time at;
  std::string err;
  if (absl::ParseTime(absl::RFC3339_full, text, &at, &err)) return absl::ToUnixMillis(at);
  return std::nullopt;
}

int CmdEvents(Client& c, const std::string& job, uint64_t after, int limit, const std::string& since,
              const std::string& kind, bool json) {
  v1::ListEventsRequest req;
  req.set_job_id(job);
  req.set_after_id(after);
  req.set_limit(limit);
  req.set_kind(kind);
  const std::optional<int64_t> since_ms = ParseSince(since);
  if (!since_ms) {
    std::cerr << "shardctl events: --since '" << since
              << "' is neither a duration (90m, 24h) nor a time (2026-12-01T08:00:00Z)\n";
    return kExitUsage;
  }
  req.set_since_unix_ms(*since_ms);
  v1::ListEventsResponse resp;
  if (!c.Call("ListEvents", &v1::Coordinator::Stub::ListEvents, req, &resp)) return kExitUnreachable;
  if (int rc = CheckJob(c, job, !resp.events().empty()); rc != kExitOk) return rc;
  if (json) {
    std::cout << ToJson(resp) << "\n";
    return kExitOk;
  }
  for (const auto& e : resp.events()) {
    // Only what the event concerns: a daemon event names no job, a job event no rank or group.
    std::string subject;
    if (!e.job_id().empty()) absl::StrAppend(&subject, " job=", e.job_id());
    if (e.rank() >= 0) absl::StrAppend(&subject, " rank=", e.rank());
    if (e.group() >= 0) absl::StrAppend(&subject, " group=", e.group());
    std::cout << absl::StrFormat("%6d %s %-7s %-20s%s %s\n", e.id(), FormatTime(e.unix_ms()), e.severity(),
                                 e.kind(), subject, e.message());
  }
  return kExitOk;
}

int CmdComms(Client& c, const std::string& job, bool json) {
  v1::ListCommsRequest req;
  req.set_job_id(job);
  v1::ListCommsResponse resp;
  if (!c.Call("ListComms", &v1::Coordinator::Stub::ListComms, req, &resp)) return kExitUnreachable;
  if (int rc = CheckJob(c, job, !resp.comms().empty()); rc != kExitOk) return rc;
  if (json) {
    std::cout << ToJson(resp) << "\n";
    return kExitOk;
  }
  const int job_w = ColumnWidth(resp.comms(), 10, [](const auto& c) -> const std::string& { return c.job_id(); });
  const int name_w = ColumnWidth(resp.comms(), 12, [](const auto& c) -> const std::string& { return c.name(); });
  // The world communicator of 65,536 ranks would pad every row by 400 KB: a rank list past 64
  // characters runs over its column on its own row only.
  const int ranks_w =
      std::min(64, ColumnWidth(resp.comms(), 16, [](const auto& c) { return absl::StrJoin(c.ranks(), ","); }));
  std::cout << absl::StrFormat("%-*s %-*s %5s %-8s %-*s %7s  %s\n", job_w, "JOB", name_w, "COMM", "EPOCH", "STATE",
                               ranks_w, "RANKS", "ABORTED", "MEMBERS (rank:state@completed/issued) / WHY");
  for (const auto& cm : resp.comms()) {
    std::vector<std::string> members;
    for (const auto& m : cm.members()) {
      members.push_back(absl::StrCat(m.rank(), ":", m.state(), "@", m.completed(), "/", m.issued()));
    }
    std::string note = absl::StrJoin(members, " ");
    if (!cm.abort_reason().empty()) note += "  / " + cm.abort_reason();
    if (!cm.behind().empty()) note += "  / BEHIND: " + cm.behind();
    std::cout << absl::StrFormat("%-*s %-*s %5d %-8s %-*s %7d  %s\n", job_w, cm.job_id(), name_w, cm.name(),
                                 cm.epoch(), shardcoord::StateName(cm.state()), ranks_w,
                                 absl::StrJoin(cm.ranks(), ","), cm.epochs_aborted(), note);
  }
  return kExitOk;
}

int CmdWatch(Client& client, const std::string& job, int interval_ms, int count) {
  auto fetch = [&] {
    shardcoord::client::WatchFrame f;
    v1::StatusRequest sreq;
    sreq.set_job_id(job);
    v1::ListGroupsRequest greq;
    greq.set_job_id(job);
    v1::ListRanksRequest rreq;
    rreq.set_job_id(job);
    grpc::Status s = client.Try(&v1::Coordinator::Stub::GetStatus, sreq, &f.status);
    if (s.ok()) s = client.Try(&v1::Coordinator::Stub::ListGroups, greq, &f.groups);
    if (s.ok()) s = client.Try(&v1::Coordinator::Stub::ListRanks, rreq, &f.ranks);
    if (!s.ok()) f.error = "cannot read the coordinator: " + s.error_message();
    return f;
  };
  return shardcoord::client::RunWatch(fetch, client.address, absl::Milliseconds(interval_ms), count);
}

// The options of the query commands (status, ranks, groups, decisions, comms, watch, events).
struct QueryFlags {
  std::string job;  // --job: only this job (every query).
  bool json = false;
  int group = -1;  // decisions
  int limit = 20;
  int watch_interval_ms = 1000;  // watch
  int watch_count = 0;
  uint64_t after = 0;  // events
  int event_limit = 100;
  std::string since, kind;
};

// The options of `shardctl replay` as given; ReplayOptionsFrom checks and completes them.
struct ReplayFlags {
  std::string trace_path, ranks_arg, modules_arg, manifest_path, policy, fallback, output, cost_path;
  shardcoord::client::ReplayOptions ro;  // What the flags set directly.
  int interval_ms = 0;
  int decision_timeout_ms = 60000;
  int connect_timeout_ms = 10000;
  int reconnect_window_ms = static_cast<int>(absl::ToInt64Milliseconds(shardcoord::kDefaultReconnectWindow));
  bool no_outer = false;
};

struct VerifyFlags {
  std::vector<std::string> files;
  bool complete = false;
};

// The options of `shardctl plan` as given; CmdPlan reads the files they name.
struct PlanFlags {
  std::string trace_path, manifest_path, cost_path;
  std::string policies = "root,replicate,per_layer,dummy,sc_per_layer,auto";
  std::string fallback = "root";
  shardcoord::client::PlanOptions po;  // What the flags set directly.
};

// Everything the command line says.
struct CliOptions {
  std::string address;  // --coordinator; empty: $SHARDCOORD_ADDR, then kDefaultAddress.
  shardcoord::TlsFiles tls;
  int timeout_ms = 5000;
  QueryFlags query;
  ReplayFlags replay;
  VerifyFlags verify;
  PlanFlags plan;
};

// The subcommands, to tell which one was given.
struct Commands {
  CLI::App* status = nullptr;
  CLI::App* ranks = nullptr;
  CLI::App* groups = nullptr;
  CLI::App* decisions = nullptr;
  CLI::App* comms = nullptr;
  CLI::App* watch = nullptr;
  CLI::App* events = nullptr;
  CLI::App* replay = nullptr;
  CLI::App* verify = nullptr;
  CLI::App* plan = nullptr;
  // The commands an unknown command's error lists.
  std::vector<CLI::App*> Listed() const {
    return {status, ranks, groups, decisions, comms, watch, events, replay, verify, plan};
  }
};

void AddGlobalOptions(CLI::App& app, CliOptions* o) {
  app.set_version_flag("--version", std::string("shardctl ") + shardcoord::kVersion);
  app.require_subcommand(1);
  // Global options also work after the subcommand: `shardctl status --coordinator ADDR`.
  app.fallthrough();
  // $SHARDCOORD_ADDR is read by ResolveAddress, not with envname(), so that an error names its source.
  app.add_option("--coordinator", o->address,
                 "coordinator HOST:PORT or [IPV6]:PORT (default $SHARDCOORD_ADDR, then 127.0.0.1:7871)");
  app.add_option("--tls-ca", o->tls.ca_file, "PEM CA bundle that signed the coordinator's certificate (TLS; "
                 "default $SHARDCOORD_TLS_CA)");
  app.add_option("--tls-cert", o->tls.cert_file, "PEM client certificate, for mutual TLS (default $SHARDCOORD_TLS_CERT)");
  app.add_option("--tls-key", o->tls.key_file, "PEM key of --tls-cert (default $SHARDCOORD_TLS_KEY)");
  app.add_option("--tls-server-name", o->tls.server_name,
                 "name the coordinator's certificate must carry, if not the host dialled ($SHARDCOORD_TLS_SERVER_NAME)");
  app.add_option("--timeout-ms", o->timeout_ms, "deadline of each query RPC")
      ->check(CLI::Range(1, kMaxTimeoutMs));
}

// A query subcommand with the options every query has.
CLI::App* AddQuery(CLI::App& app, const std::string& name, const std::string& description, QueryFlags* q) {
  CLI::App* sub = app.add_subcommand(name, description);
  sub->add_option("--job", q->job, "only this job id");
  sub->add_flag("--json", q->json, "print JSON (protobuf JSON mapping, snake_case fields)");
  return sub;
}

CLI::App* AddDecisionsCommand(CLI::App& app, QueryFlags* q) {
  CLI::App* decisions = AddQuery(app, "decisions", "recent decisions per group", q);
  decisions->add_option("--group", q->group, "only this group (default: all)");
  decisions->add_option("--limit", q->limit, "most recent decisions per group")->check(CLI::Range(1, kMaxLimit));
  return decisions;
}

CLI::App* AddWatchCommand(CLI::App& app, QueryFlags* q) {
  CLI::App* watch = AddQuery(app, "watch", "live view that redraws in place, like top (keys: h help, s sort, f filter "
                                           "by job, arrows scroll, r refresh, q or Ctrl-C quits); plain frames "
                                           "when output is not a terminal", q);
  watch->add_option("--interval-ms", q->watch_interval_ms, "refresh interval")->check(CLI::Range(50, 3600000));
  watch->add_option("--count", q->watch_count, "stop after this many frames (default: until q or Ctrl-C)")
      ->check(CLI::NonNegativeNumber);
  return watch;
}

CLI::App* AddEventsCommand(CLI::App& app, QueryFlags* q) {
  CLI::App* events = AddQuery(app, "events", "the event journal (registrations, deaths, failures)", q);
  events->add_option("--after", q->after, "only events with a larger id");
  events->add_option("--since", q->since, "only events since this long ago (90m, 24h) or this time (RFC 3339)");
  events->add_option("--kind", q->kind, "only events of this kind (rank_dead, group_failed, rank_registered, ...)");
  events->add_option("--limit", q->event_limit, "at most this many events (a page: 1..10000; --after pages on)")
      ->check(CLI::Range(1, 10000));
  return events;
}

void AddQueryCommands(CLI::App& app, QueryFlags* q, Commands* c) {
  c->status = AddQuery(app, "status", "coordinator and job summary", q);
  c->ranks = AddQuery(app, "ranks", "every rank: state, heartbeat age, plans, why dead", q);
  c->groups = AddQuery(app, "groups", "every shard group: state, epoch, decisions by kind", q);
  c->decisions = AddDecisionsCommand(app, q);
  c->comms = AddQuery(app, "comms", "every communicator: epoch, state, members, why aborted", q);
  c->watch = AddWatchCommand(app, q);
  c->events = AddEventsCommand(app, q);
}

// The replay's job: what its ranks register, and how they reach the coordinator.
void AddReplayJobOptions(CLI::App* replay, ReplayFlags* f) {
  using shardcoord::client::kMaxReplayWorldSize;
  replay->add_option("trace", f->trace_path, "trace file, JSON lines ('-' for stdin)")->required();
  replay->add_option("--job-id", f->ro.job_id, "job id to register (default 'replay')");
  replay->add_option("--world-size", f->ro.world_size, "ranks in the job (default: highest rank in the trace + 1)")
      ->check(CLI::Range(1, kMaxReplayWorldSize));
  replay->add_option("--group-size", f->ro.group_size, "shard group size (default: world size)")
      ->check(CLI::Range(1, kMaxReplayWorldSize));
  replay->add_option("--reconnect-window-ms", f->reconnect_window_ms,
                     "after losing the coordinator, how long each rank reconnects and resumes before failing (0: fail at once)")
      ->check(CLI::NonNegativeNumber);
  replay->add_option("--daemon", f->ro.daemon,
                     "without --coordinator: the shardcoordd to start for the replay (default: $SHARDCOORDD, the one "
                     "beside shardctl, or on PATH)");
  replay->add_option("--connect-timeout-ms", f->connect_timeout_ms, "deadline to reach the coordinator and register")
      ->check(CLI::Range(1, kMaxTimeoutMs));
  replay->add_option("--policy", f->policy, "auto, per_layer, root or replicate (default: the coordinator's)")
      ->check(CLI::IsMember(shardcoord::PolicyNames()));
  replay->add_option("--fallback", f->fallback, "root, replicate or padded (default: the coordinator's)")
      ->check(CLI::IsMember(shardcoord::FallbackNames()));
  replay->add_option("--modules", f->modules_arg, "controlled module names, comma-separated (default: those in the trace)");
  replay->add_option("--manifest", f->manifest_path, "manifest JSON file instead of --modules")->check(CLI::ExistingFile);
  replay->add_flag("--no-outer-root", f->no_outer, "register wrap_outer_model=false");
  replay->add_option("--cost", f->cost_path,
                     "cost model JSON file (shardcoord.cost/v1): every rank reports it before its first plan, so "
                     "auto decides by cost as `shardctl plan` predicts")
      ->check(CLI::ExistingFile);
}

// How the replay plays: which ranks, at what pace, and where its decisions go.
void AddReplayRunOptions(CLI::App* replay, ReplayFlags* f) {
  replay->add_option("--ranks", f->ranks_arg, "play only these ranks, e.g. 0,1,5 (default: all)");
  replay->add_option("--interval-ms", f->interval_ms, "pause between a rank's microbatches, like a trainer")
      ->check(CLI::Range(0, kMaxTimeoutMs));
  replay->add_option("--lookahead", f->ro.lookahead, "plans each rank reports ahead")->check(CLI::Range(1, kMaxLimit));
  replay->add_option("--memory-budget-bytes", f->ro.memory_budget_bytes, "reported per rank, enables auto promotion");
  replay->add_option("--decision-timeout-ms", f->decision_timeout_ms, "deadline for each decision")
      ->check(CLI::Range(1, kMaxTimeoutMs));
  replay->add_flag("--per-rank", f->ro.per_rank, "one line per rank: what each rank received");
  replay->add_option("--output", f->output, "write decisions here instead of stdout");
}

CLI::App* AddVerifyCommand(CLI::App& app, VerifyFlags* v) {
  CLI::App* verify = app.add_subcommand(
      "verify", "check that per-rank replay outputs (--per-rank) of one job agree within each group");
  verify->add_option("files", v->files, "outputs of `shardctl replay --per-rank`")->required()->check(CLI::ExistingFile);
  verify->add_flag("--complete", v->complete,
                   "also fail (exit 3) when a rank's output lacks a decision its group mates received (a rank "
                   "that failed or was killed lacks some legitimately; without the flag they are counted)");
  return verify;
}

constexpr char kPlanFooter[] = R"(
A trace from a published data mix (docs/MIXES.md), piped in:
  python3 scripts/make_trace.py --mix qwen25vl_sft --world-size 8 --steps 20 --microbatches 4 \
      --samples-per-microbatch 4 --arrange none \
    | shardctl plan - --manifest examples/plan/manifest.json --cost examples/plan/cost_example.json

Policies: root, replicate (static; a static replica never gathers), per_layer (static, no
coordinator: HANGS where ranks diverge), dummy (per_layer, every rank of a group running the
module as often as its busiest rank), sc_per_layer and auto (the daemon's DecisionEngine,
with --fallback: root by default, or padded, replicate; auto promotes with --budget-bytes). A trace whose lines give their decoder
"tokens" (scripts/make_trace.py --tokens, bench/policy_matrix.py --trace-dir) is priced per token
where the cost file has other_seconds_per_token. Exit codes: 0 ok, 2 bad input.)";

CLI::App* AddPlanCommand(CLI::App& app, PlanFlags* f) {
  using shardcoord::client::kMaxReplayWorldSize;
  CLI::App* plan = app.add_subcommand(
      "plan", "what-if planner: per policy, decisions by kind, bytes gathered, peak frozen memory and estimated "
              "time per step, from a trace, a manifest and a cost model (no coordinator)");
  plan->add_option("trace", f->trace_path, "trace file, JSON lines ('-' for stdin)")->required();
  plan->add_option("--manifest", f->manifest_path, "manifest JSON file: the modules and their bytes")
      ->required()->check(CLI::ExistingFile);
  plan->add_option("--cost", f->cost_path, "cost model JSON file (format shardcoord.cost/v1)")
      ->required()->check(CLI::ExistingFile);
  plan->add_option("--world-size", f->po.world_size, "ranks in the job (default: highest rank in the trace + 1)")
      ->check(CLI::Range(1, kMaxReplayWorldSize));
  plan->add_option("--group-size", f->po.group_size,
                   "shard group size (default: the cost file's group_size, else the world size)")
      ->check(CLI::Range(1, kMaxReplayWorldSize));
  plan->add_option("--policies", f->policies,
                   "those to estimate, in this order, from root,replicate,per_layer,dummy,sc_per_layer,auto "
                   "(default: all)");
  plan->add_option("--budget-bytes", f->po.budget_bytes,
                   "frozen memory per rank beyond its shards; a policy whose peak exceeds it is not best, and "
                   "auto promotes to replicate within it (default 0: none)")
      ->check(CLI::NonNegativeNumber);
  plan->add_option("--fallback", f->fallback,
                   "sc_per_layer's and auto's fallback for divergent calls: root, replicate or padded (default root)")
      ->check(CLI::IsMember(shardcoord::FallbackNames()));
  plan->add_flag("--json", f->po.json, "one JSON object per policy per line instead of the table");
  plan->footer(kPlanFooter);
  return plan;
}

// Defines every option and subcommand, bound to `o`.
Commands DefineCommandLine(CLI::App& app, CliOptions* o) {
  Commands c;
  AddGlobalOptions(app, o);
  AddQueryCommands(app, &o->query, &c);
  c.replay = app.add_subcommand("replay", "play simulated ranks from a JSON-lines trace through a coordinator");
  AddReplayJobOptions(c.replay, &o->replay);
  AddReplayRunOptions(c.replay, &o->replay);
  c.verify = AddVerifyCommand(app, &o->verify);
  c.plan = AddPlanCommand(app, &o->plan);
  return c;
}

// The exit code of a command line CLI11 refused (or of --help, --version).
int ParseFailure(CLI::App& app, const CLI::ParseError& e, const Commands& c) {
  if (dynamic_cast<const CLI::RequiredError*>(&e) == nullptr || !app.get_subcommands().empty()) {
    return app.exit(e) == 0 ? kExitOk : kExitUsage;
  }
  // CLI11 would only say "A subcommand is required", also for `shardctl bogus`.
  std::vector<std::string> names;
  for (const CLI::App* cmd : c.Listed()) names.push_back(cmd->get_name());
  std::string unknown;
  for (const std::string& arg : app.remaining()) {
    if (!absl::StartsWith(arg, "-")) {
      unknown = arg;
      break;
    }
  }
  std::cerr << "shardctl: "
            << (unknown.empty() ? std::string("no command given") : absl::StrCat("unknown command '", unknown, "'"))
            << "; the commands are " << absl::StrJoin(names, ", ") << " (shardctl --help)\n";
  return kExitUsage;
}

// Completes `address` from $SHARDCOORD_ADDR when --coordinator is not given (it stays empty
// when neither is). False, and one line on stderr, when it is not HOST:PORT or [IPV6]:PORT.
bool ResolveAddress(std::string* address) {
  std::string source = "--coordinator";
  if (address->empty()) {
    const char* env = std::getenv(kAddressEnv);
    if (env != nullptr) *address = env;
    source = kAddressEnv;
  }
  if (address->empty()) return true;
  const std::string problem = AddressProblem(*address);
  if (problem.empty()) return true;
  std::cerr << "shardctl: " << source << " '" << *address << "' is not a coordinator address: " << problem
            << "; expected HOST:PORT or [IPV6]:PORT with a port in 1..65535, e.g. " << kDefaultAddress << "\n";
  return false;
}

// --ranks: comma-separated integers. False, and one line on stderr, when it is not.
bool ParseRanks(const std::string& ranks_arg, std::vector<int>* ranks) {
  for (absl::string_view part : absl::StrSplit(ranks_arg, ',', absl::SkipEmpty())) {
    int r;
    if (!absl::SimpleAtoi(part, &r)) {
      std::cerr << "shardctl replay: --ranks '" << ranks_arg << "' must be comma-separated integers\n";
      return false;
    }
    ranks->push_back(r);
  }
  return true;
}

absl::StatusOr<std::vector<shardcoord::ModuleSpec>> ReadManifest(const std::string& path) {
  std::ifstream mf(path);
  std::stringstream ss;
  ss << mf.rdbuf();
  return shardcoord::client::ParseManifest(ss.str(), path);
}

// The modules of --manifest or --modules (none: the trace's). False, and one line on stderr,
// when both are given, the manifest is bad, or a name is empty or given twice.
bool ReadModules(const ReplayFlags& f, std::vector<shardcoord::ModuleSpec>* modules) {
  if (!f.manifest_path.empty() && !f.modules_arg.empty()) {
    std::cerr << "shardctl replay: give --modules or --manifest, not both\n";
    return false;
  }
  if (!f.manifest_path.empty()) {
    auto manifest = ReadManifest(f.manifest_path);
    if (!manifest.ok()) {
      std::cerr << "shardctl replay: " << manifest.status().message() << "\n";
      return false;
    }
    *modules = *manifest;
  }
  for (absl::string_view name : absl::StrSplit(f.modules_arg, ',', absl::SkipEmpty())) {
    modules->push_back({std::string(name), 0, {}, false});
  }
  std::set<std::string> seen;
  for (const auto& m : *modules) {
    if (m.name.empty() || !seen.insert(m.name).second) {
      std::cerr << "shardctl replay: module '" << m.name << "' is empty or given twice\n";
      return false;
    }
  }
  return true;
}

absl::StatusOr<shardcoord::client::CostFile> ReadCostFile(const std::string& path);

// --cost's modules as every rank reports them; false (and one line on stderr) on a bad file.
bool ReadReplayCosts(const std::string& path, std::vector<shardcoord::ModuleCost>* costs) {
  if (path.empty()) return true;
  const auto file = ReadCostFile(path);
  if (!file.ok()) {
    std::cerr << "shardctl replay: " << file.status().message() << "\n";
    return false;
  }
  for (const auto& m : file->modules) costs->push_back(m.cost);
  return true;
}

// The replay's options from its flags; nullopt (and one line on stderr) on bad input.
std::optional<shardcoord::client::ReplayOptions> ReplayOptionsFrom(const ReplayFlags& f, const std::string& address,
                                                                   const shardcoord::TlsFiles& tls) {
  shardcoord::client::ReplayOptions ro = f.ro;
  ro.coordinator = address;  // Empty: a shardcoordd started for the replay.
  if (!f.policy.empty()) ro.policy = *shardcoord::ParsePolicy(f.policy);
  if (!f.fallback.empty()) ro.fallback = *shardcoord::ParseFallback(f.fallback);
  ro.wrap_outer_model = !f.no_outer;
  ro.interval = absl::Milliseconds(f.interval_ms);
  ro.decision_timeout = absl::Milliseconds(f.decision_timeout_ms);
  ro.connect_timeout = absl::Milliseconds(f.connect_timeout_ms);
  ro.reconnect_window = absl::Milliseconds(f.reconnect_window_ms);
  ro.tls = tls;
  if (!f.ranks_arg.empty() && !ParseRanks(f.ranks_arg, &ro.ranks)) return std::nullopt;
  if (!ReadModules(f, &ro.modules) || !ReadReplayCosts(f.cost_path, &ro.costs)) return std::nullopt;
  return ro;
}

// The trace from a file, or from stdin for "-".
absl::StatusOr<shardcoord::client::Trace> ReadTrace(const std::string& path) {
  if (path == "-") return shardcoord::client::ParseTrace(std::cin, "<stdin>");
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read trace ", path));
  return shardcoord::client::ParseTrace(in, path);
}

int CmdReplay(const ReplayFlags& f, const std::string& address, const shardcoord::TlsFiles& tls) {
  using shardcoord::client::kReplayBadInput;
  const std::optional<shardcoord::client::ReplayOptions> ro = ReplayOptionsFrom(f, address, tls);
  if (!ro) return kReplayBadInput;
  const absl::StatusOr<shardcoord::client::Trace> trace = ReadTrace(f.trace_path);
  if (!trace.ok()) {
    std::cerr << "shardctl replay: " << trace.status().message() << "\n";
    return kReplayBadInput;
  }
  if (f.output.empty()) return shardcoord::client::RunReplay(*trace, *ro, std::cout, std::cerr);
  std::ofstream out(f.output);
  if (!out) {
    std::cerr << "shardctl replay: cannot write " << f.output << "\n";
    return kReplayBadInput;
  }
  return shardcoord::client::RunReplay(*trace, *ro, out, std::cerr);
}

// --policies: names of PlanPolicy, comma-separated. False, and one line on stderr, when one
// is unknown or given twice.
bool ParsePlanPolicies(const std::string& text, std::vector<shardcoord::client::PlanPolicy>* policies) {
  for (absl::string_view name : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const auto p = shardcoord::client::ParsePlanPolicy(std::string(name));
    if (!p || std::find(policies->begin(), policies->end(), *p) != policies->end()) {
      std::cerr << "shardctl plan: --policies '" << text << "': '" << name
                << "' is unknown or given twice; the policies are root, replicate, per_layer, dummy, "
                   "sc_per_layer, auto\n";
      return false;
    }
    policies->push_back(*p);
  }
  return true;
}

absl::StatusOr<shardcoord::client::CostFile> ReadCostFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read cost file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return shardcoord::client::ParseCostFile(ss.str(), path);
}

int CmdPlan(const PlanFlags& f) {
  using shardcoord::client::kPlanBadInput;
  shardcoord::client::PlanOptions po = f.po;
  po.policies.clear();
  if (!ParsePlanPolicies(f.policies, &po.policies)) return kPlanBadInput;
  po.fallback = *shardcoord::ParseFallback(f.fallback);  // CLI11 checked the name.
  // The first input that fails stops the others.
  const auto manifest = ReadManifest(f.manifest_path);
  const auto costs = manifest.ok() ? ReadCostFile(f.cost_path) : manifest.status();
  const auto trace = costs.ok() ? ReadTrace(f.trace_path) : costs.status();
  if (!trace.ok()) {
    std::cerr << "shardctl plan: " << trace.status().message() << "\n";
    return kPlanBadInput;
  }
  po.trace_name = f.trace_path == "-" ? "<stdin>" : f.trace_path;
  po.cost_name = f.cost_path;
  return shardcoord::client::RunPlan(*trace, *manifest, *costs, po, std::cout, std::cerr);
}

// Connects to the coordinator and runs the query command given.
int RunQuery(const Commands& c, const CliOptions& o) {
  Client client;
  client.address = o.address.empty() ? kDefaultAddress : o.address;
  client.tls = o.tls;
  client.timeout_ms = o.timeout_ms;
  auto token = shardcoord::ResolveToken("");
  if (!token.ok()) {
    std::cerr << "shardctl: " << token.status().message() << "\n";
    return kExitUsage;
  }
  client.token = *token;
  if (!client.Connect()) return kExitUsage;
  const QueryFlags& q = o.query;
  if (c.status->parsed()) return CmdStatus(client, q.job, q.json);
  if (c.ranks->parsed()) return CmdRanks(client, q.job, q.json);
  if (c.groups->parsed()) return CmdGroups(client, q.job, q.json);
  if (c.decisions->parsed()) return CmdDecisions(client, q.job, q.group, q.limit, q.json);
  if (c.comms->parsed()) return CmdComms(client, q.job, q.json);
  if (c.watch->parsed()) return CmdWatch(client, q.job, q.watch_interval_ms, q.watch_count);
  if (c.events->parsed()) return CmdEvents(client, q.job, q.after, q.event_limit, q.since, q.kind, q.json);
  return kExitOk;
}

// Runs the command the parsed command line gives.
int Run(const Commands& c, CliOptions& o) {
  if (c.verify->parsed()) {
    return shardcoord::client::VerifyPerRankOutputs(o.verify.files, std::cout, std::cerr, o.verify.complete);
  }
  if (c.plan->parsed()) return CmdPlan(o.plan);
  if (c.replay->parsed() && std::getenv(shardcoord::logging::kLevelEnv) == nullptr) {
    // The simulated workers log only problems by default (the replay's own shardcoordd logs to a file).
    shardcoord::logging::SetLevel("warn");
  }
  // Every command from here on talks to a coordinator (verify and plan, which do not, returned).
  if (!ResolveAddress(&o.address)) return kExitUsage;
  if (c.replay->parsed()) return CmdReplay(o.replay, o.address, o.tls);
  return RunQuery(c, o);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardctl: query a shardcoord coordinator, replay a plan trace through one, or plan placements "
               "from a trace and a cost model"};
  CliOptions options;
  const Commands commands = DefineCommandLine(app, &options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return ParseFailure(app, e, commands);
  }
  return Run(commands, options);
}
