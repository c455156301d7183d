// Uses only the installed public headers and exported symbols.
#include <iostream>

#include "shardcoord/classify.h"
#include "shardcoord/worker.h"

int main() {
  auto picked = shardcoord::ClassifyModules({{"model.vision_tower", 2, 0}, {"model.vision_tower.vision_model", 1, 0}});
  shardcoord::WorkerOptions o;  // No coordinator: Connect must fail cleanly with a message.
  o.job_id = "j";
  o.rank = 0;
  o.world_size = 1;
  o.group_size = 1;
  o.coordinator_address = "127.0.0.1:1";
  o.connect_timeout = absl::Milliseconds(200);
  auto w = shardcoord::Worker::Connect(o);
  std::cout << "picked " << picked.size() << " " << shardcoord::PolicyName(shardcoord::Policy::kAuto) << " "
            << (w.ok() ? "connected" : std::string(w.status().message())) << "\n";
  return picked.size() == 1 && !w.ok() ? 0 : 1;
}
