#include "coordinator/server/ticker.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "shardcoord/internal/logging.h"

namespace shardcoord::coordinator {

Ticker::Ticker(CoordinatorCore* core)
    : core_(core),
      period_(std::max(absl::Milliseconds(5),
                       std::min(absl::Milliseconds(100), core->options().heartbeat_interval / 2))),
      pause_(core->options().heartbeat_timeout / 2) {}

namespace {

constexpr absl::Duration kTrimEvery = absl::Seconds(10);

int64_t ResidentBytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE);
}

}  // namespace

void Ticker::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
  if (!trim_thread_.joinable()) trim_thread_ = std::thread([this] { TrimLoop(); });
}

void Ticker::TrimLoop() {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), kTrimEvery)) {
    mu_.Unlock();
    const int64_t before = ResidentBytes();
    const absl::Time start = absl::Now();
    malloc_trim(0);
    const int64_t released = before - ResidentBytes();
    if (released > (16 << 20)) {
      logging::Get("coordinator")
          ->debug("gave {} MB of freed heap back to the system in {} ms", released >> 20,
                  absl::ToInt64Milliseconds(absl::Now() - start));
    }
    mu_.Lock();
  }
}

void Ticker::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  if (trim_thread_.joinable()) trim_thread_.join();
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
    core_->Tick(now);  // Checks again once it holds the core's lock (a pause may fall in between).
    mu_.Lock();
  }
}

}  // namespace shardcoord::coordinator
