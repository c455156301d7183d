#include "comm_registry.h"

namespace shardcoord::internal {

void CommRegistry::Add(std::shared_ptr<AbortableCommunicator> comm) {
  absl::MutexLock lock(&mu_);
  // Forget the communicators the trainer dropped: the map stays as small as what is open.
  for (auto it = comms_.begin(); it != comms_.end();) {
    it = it->second.expired() ? comms_.erase(it) : std::next(it);
  }
  comms_[comm->name()] = comm;
}

std::shared_ptr<AbortableCommunicator> CommRegistry::Find(const std::string& name, int64_t epoch) const {
  absl::MutexLock lock(&mu_);
  auto it = comms_.find(name);
  if (it == comms_.end()) return nullptr;
  auto comm = it->second.lock();
  return comm && comm->epoch() == epoch ? comm : nullptr;
}

std::vector<std::shared_ptr<AbortableCommunicator>> CommRegistry::Open() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<AbortableCommunicator>> out;
  for (const auto& [name, weak] : comms_) {
    if (auto c = weak.lock()) out.push_back(std::move(c));
  }
  return out;
}

std::vector<CommRegistry::Progress> CommRegistry::Snapshot() const {
  std::vector<Progress> out;
  for (const auto& comm : Open()) {
    Progress p{comm->name(), comm->epoch()};
    comm->Progress(&p.issued, &p.completed);
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace shardcoord::internal
