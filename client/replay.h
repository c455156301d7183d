// `shardctl replay`: plays simulated ranks from a trace through a real coordinator (a shardcoordd
// it starts for the replay, or a running one), each rank through the real worker library,
// and checks that every rank of a group received the identical decisions.
#ifndef SHARDCOORD_CLIENT_REPLAY_H_
#define SHARDCOORD_CLIENT_REPLAY_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "shardcoord/types.h"
#include "shardcoord/worker.h"
#include "trace.h"

namespace shardcoord::client {

struct ReplayOptions {
  std::string coordinator;  // Empty: start a shardcoordd for the replay on 127.0.0.1:0 (daemon_process.h).
  std::string daemon;       // That shardcoordd's path (empty: FindDaemon's search).
  std::string job_id = "replay";
  int world_size = 0;       // 0: highest rank in the trace + 1.
  int group_size = 0;       // 0: world_size (one group).
  Policy policy = Policy::kUnspecified;
  Fallback fallback = Fallback::kUnspecified;
  bool wrap_outer_model = true;
  std::vector<ModuleSpec> modules;  // Empty: every module the trace names, sorted.
  std::vector<int> ranks;           // Empty: every rank of the world.
  int lookahead = 4;
  int64_t memory_budget_bytes = 0;
  absl::Duration interval = absl::ZeroDuration();  // Pause between a rank's microbatches.
  absl::Duration decision_timeout = absl::Seconds(60);
  absl::Duration connect_timeout = absl::Seconds(30);
  absl::Duration reconnect_window = kDefaultReconnectWindow;  // See WorkerOptions.
  bool per_rank = false;
  TlsFiles tls;  // See WorkerOptions; empty fields come from the environment.
  // Each rank reports these costs (Worker::ReportCosts) before its first plan, as a measuring
  // trainer would: the coordinator's `auto` then decides by cost from the first microbatch, as
  // `shardctl plan` assumes. Empty: no report (auto counts).
  std::vector<ModuleCost> costs;
};

// Exit codes of `shardctl replay`.
inline constexpr int kReplayOk = 0;
inline constexpr int kReplayRankFailed = 1;
inline constexpr int kReplayBadInput = 2;
inline constexpr int kReplayDiverged = 3;

// Most ranks one replay process simulates: each is a thread with a worker and its own
// stream. More ranks: several processes with --ranks against one coordinator.
inline constexpr int kMaxReplayRanks = 4096;
// The largest world size a replay registers: kMaxReplayWorldSize (trace.h).

// Runs the replay, writing decisions as JSON lines to `out` and failures to `err`.
// Returns one of the exit codes above.
int RunReplay(const Trace& trace, ReplayOptions options, std::ostream& out, std::ostream& err);

// `shardctl verify`: reads the --per-rank outputs of several replay processes and checks
// that all ranks of each group received the same decision and seq for every microbatch
// and module. Prints a summary by decision kind (each group decision counted once).
// Returns kReplayOk, kReplayBadInput or kReplayDiverged.
// Decisions some rank of a group lacks while others received them are counted and named;
// with `complete` they also fail the check (a rank that failed or was killed lacks the
// decisions after its end legitimately, so by default they do not).
int VerifyPerRankOutputs(const std::vector<std::string>& files, std::ostream& out,
                         std::ostream& err, bool complete = false);

}  // namespace shardcoord::client

#endif  // SHARDCOORD_CLIENT_REPLAY_H_
