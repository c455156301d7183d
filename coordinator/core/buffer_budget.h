// BufferBudget: the daemon-wide bound on memory held for clients (issue 25, DESIGN 11).
//
// Per-session bounds (max_outbox_bytes, the 4 MiB message limit) do not bound the total:
// 8 ranks that stop reading held 8 x 16 MiB of queued messages, a resume up to 4 MiB waits
// for its group for the whole recovery window. Every such buffer takes its bytes from one
// budget (`max_buffered_bytes`) and gives them back when freed. Thread-safe, lock-free.
#ifndef SHARDCOORD_COORDINATOR_CORE_BUFFER_BUDGET_H_
#define SHARDCOORD_COORDINATOR_CORE_BUFFER_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <utility>

namespace shardcoord::coordinator {

// What one queued outgoing message costs in memory, estimated from its wire size without
// walking it: a decision batch of 4 decisions is 347 bytes on the wire and 1464 bytes as a
// protobuf object (SpaceUsedLong, which costs 6x ByteSizeLong: too slow for every send).
inline int64_t QueuedMessageCost(int64_t wire_bytes) { return 64 + 4 * wire_bytes; }

class BufferBudget {
 public:
  // A holder of at most this many bytes is never refused: an honest reader's queue is
  // short, and a daemon whose budget is spent by others must still answer it.
  static constexpr int64_t kSmallHolder = 64 << 10;

  explicit BufferBudget(int64_t limit) : limit_(limit) {}
  BufferBudget(const BufferBudget&) = delete;
  BufferBudget& operator=(const BufferBudget&) = delete;

  // Takes `bytes` for a holder that already holds `held`. Refused (false, nothing taken)
  // when the total would pass the limit and the holder would pass kSmallHolder: the
  // buffers are full, and the biggest holders are the ones to give up.
  bool TryTake(int64_t bytes, int64_t held) {
    const int64_t total = used_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    if (total > limit_ && held + bytes > kSmallHolder) {
      used_.fetch_sub(bytes, std::memory_order_relaxed);
      return false;
    }
    return true;
  }
  // Takes `bytes` for a holder that is never exempt (a resume): refused past the limit.
  bool TryTakeStrict(int64_t bytes) {
    const int64_t total = used_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    if (total > limit_) {
      used_.fetch_sub(bytes, std::memory_order_relaxed);
      return false;
    }
    return true;
  }
  // Takes `bytes` whatever the limit: for a rank that reads (its queue moves), which is never
  // refused for others' bytes; the core then cuts the holders that do not read until the total
  // is under the limit again (CoordinatorCore::ReclaimBuffers).
  void TakeOver(int64_t bytes) { used_.fetch_add(bytes, std::memory_order_relaxed); }
  void Give(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

// Bytes taken from a BufferBudget, given back when destroyed (move-only).
class BufferCharge {
 public:
  BufferCharge() = default;
  BufferCharge(BufferBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
  BufferCharge(BufferCharge&& o) noexcept
      : budget_(std::exchange(o.budget_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  BufferCharge& operator=(BufferCharge&& o) noexcept {
    if (this != &o) {
      Release();
      budget_ = std::exchange(o.budget_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~BufferCharge() { Release(); }

  // Takes `bytes` more from `budget` (the one this charge holds, if any), as TryTake does: a
  // holder of at most kSmallHolder is served past the limit (a short store is never refused
  // because ranks that read took the budget); false, nothing taken, otherwise past the limit.
  bool Add(BufferBudget* budget, int64_t bytes) {
    if (budget_ != nullptr && budget_ != budget) return false;
    if (!budget->TryTake(bytes, bytes_)) return false;
    budget_ = budget;
    bytes_ += bytes;
    return true;
  }
  int64_t bytes() const { return bytes_; }

 private:
  void Release() {
    if (budget_ != nullptr) budget_->Give(bytes_);
    budget_ = nullptr;
    bytes_ = 0;
  }
  BufferBudget* budget_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace shardcoord::coordinator

#endif  // SHARDCOORD_COORDINATOR_CORE_BUFFER_BUDGET_H_
