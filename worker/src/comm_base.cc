#include "comm_base.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "shardcoord/internal/logging.h"

namespace shardcoord {

size_t DataTypeSize(DataType t) {
  switch (t) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kUint8: return 1;
  }
  return 1;
}

namespace internal {
namespace {

int IndexOf(const std::vector<int>& ranks, int rank) {
  return static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), rank) - ranks.begin());
}

}  // namespace

CommunicatorBase::CommunicatorBase(std::shared_ptr<EpochRendezvous> rendezvous, CommSpec spec)
    : AbortableCommunicator(spec.name, spec.epoch, IndexOf(spec.ranks, spec.job_rank), spec.ranks),
      rendezvous_(std::move(rendezvous)),
      spec_(std::move(spec)) {}

void CommunicatorBase::Abort(const std::string& reason) { AbortLogged(reason, /*expected=*/false); }

void CommunicatorBase::AbortOnClose(const std::string& reason) { AbortLogged(reason, /*expected=*/true); }

void CommunicatorBase::AbortLogged(const std::string& reason, bool expected) {
  {
    absl::MutexLock lock(&mu_);
    if (!abort_reason_.empty()) return;
    abort_reason_ = reason.empty() ? "aborted" : reason;
  }
  logging::Get("worker")->log(expected ? spdlog::level::info : spdlog::level::warn,
                              "job={} rank={} comm={} epoch={} {}: {}", spec_.job_id, spec_.job_rank, name(), epoch(),
                              expected ? "closing" : "aborting", reason);
  AbortBackend();
}

void CommunicatorBase::Progress(int64_t* issued, int64_t* completed) const {
  *issued = issued_.load(std::memory_order_relaxed);
  *completed = completed_.load(std::memory_order_relaxed);
}

absl::Status CommunicatorBase::Health() const {
  absl::MutexLock lock(&mu_);
  return UsableLocked();
}

absl::Status CommunicatorBase::UsableLocked() const {
  if (AbortedLocked()) return AbortedStatusLocked();
  if (!ConnectedLocked()) {
    return absl::FailedPreconditionError(
        absl::StrCat("communicator '", name(), "' epoch ", epoch(), " is not connected"));
  }
  return absl::OkStatus();
}

absl::Status CommunicatorBase::AbortedStatusLocked() const {
  return absl::AbortedError(absl::StrCat("communicator '", name(), "' epoch ", epoch(), " was aborted: ",
                                         abort_reason_, "; open it again to join the next epoch"));
}

absl::Status CommunicatorBase::AbortedStatus() const {
  absl::MutexLock lock(&mu_);
  return AbortedStatusLocked();
}

bool CommunicatorBase::AwaitAbort(absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  auto aborted = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return AbortedLocked(); };
  return mu_.AwaitWithTimeout(absl::Condition(&aborted), wait);
}

absl::Status CommunicatorBase::FailEpoch(const std::string& error) {
  // If the coordinator already aborted the epoch (it saw a peer die), its answer names the cause.
  absl::Status report = rendezvous_->ReportError(error);
  Abort(report.code() == absl::StatusCode::kAborted ? std::string(report.message()) : error);
  return AbortedStatus();
}

}  // namespace internal
}  // namespace shardcoord
