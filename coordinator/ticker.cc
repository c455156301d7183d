#include "coordinator/ticker.h"

#include <algorithm>

namespace shardcoord::coordinator {

Ticker::Ticker(CoordinatorCore* core)
    : core_(core),
      period_(std::max(absl::Milliseconds(5),
                       std::min(absl::Milliseconds(100), core->options().heartbeat_interval / 2))),
      pause_(core->options().heartbeat_timeout / 2) {}

void Ticker::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void Ticker::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void Ticker::Loop() {
  absl::Time last = absl::Now();
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), period_);
    if (stopping_) break;
    mu_.Unlock();  // The core takes its own lock; never hold ours across it.
    const absl::Time now = absl::Now();
    if (now - last > pause_ || now < last) core_->OnPaused(now - last);
    last = now;
    core_->Tick();
    mu_.Lock();
  }
}

}  // namespace shardcoord::coordinator
