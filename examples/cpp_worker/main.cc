// The README's "Using the worker library" example, whole: registers one rank of a job whose
// frozen tower has two layer units, reports the plans of four microbatches ahead of time (images
// in microbatches 0 and 2 on every rank, in microbatch 1 on rank 0 only) and prints each decision.
//
//   cpp_worker RANK WORLD_SIZE        (coordinator: $SHARDCOORD_ADDR)
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/time/time.h"
#include "shardcoord/version.h"
#include "shardcoord/worker.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s RANK WORLD_SIZE   (coordinator address from $SHARDCOORD_ADDR)\n", argv[0]);
    return 2;
  }
  shardcoord::WorkerOptions o;
  o.coordinator_address = "";  // empty: $SHARDCOORD_ADDR
  o.job_id = "cpp-example";
  o.rank = std::atoi(argv[1]);
  o.world_size = std::atoi(argv[2]);
  o.group_size = o.world_size;
  o.modules = {{"model.vision_tower", 2048, {{"layers.0", 1024}, {"layers.1", 1024}}, false}};
  o.lookahead = 4;
  auto worker = shardcoord::Worker::Connect(o);  // registers, with a deadline
  if (!worker.ok()) {
    std::fprintf(stderr, "cpp_worker: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  const bool images[4][2] = {{true, true}, {true, false}, {true, true}, {false, false}};
  for (int mb = 0; mb < 4; ++mb) {  // data loader, ahead of time
    const bool has_images = images[mb][o.rank % 2];
    if (auto s = (*worker)->ReportPlan({{0, mb}, {{"model.vision_tower", has_images ? 1 : 0}}}); !s.ok()) {
      std::fprintf(stderr, "cpp_worker: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  for (int mb = 0; mb < 4; ++mb) {  // training loop, right before each microbatch
    auto d = (*worker)->GetDecision({0, mb}, absl::Seconds(30));
    if (!d.ok()) {
      std::fprintf(stderr, "cpp_worker: %s\n", d.status().ToString().c_str());
      return 1;
    }
    std::printf("rank %d mb %d %s digest %016llx\n", o.rank, mb,
                shardcoord::DecisionName(d->Find("model.vision_tower")->decision),
                static_cast<unsigned long long>(d->digest));
  }
  (*worker)->Close();
  std::printf("cpp_worker %s: done\n", shardcoord::kVersion);
  return 0;
}
