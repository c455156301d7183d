// shardcoord worker: the library a trainer links to take part in the uniform-execution
// contract for frozen multimodal modules.
//
// Typical use, on every rank:
//
//   shardcoord::WorkerOptions opts;
//   opts.coordinator_address = "coord-host:7871";   // or $SHARDCOORD_ADDR
//   opts.job_id = "vlm-run-42"; opts.rank = rank; opts.world_size = world;
//   opts.group_size = 8;                            // FSDP shard group: contiguous blocks
//   opts.modules = manifest;                        // the controlled (fully frozen) modules
//   opts.lookahead = 4;
//   auto worker = shardcoord::Worker::Connect(opts);   // registers, with a deadline
//
//   // Data loader thread, ahead of time: which modules each microbatch will run.
//   (*worker)->ReportPlan({{step, mb}, {{"model.vision_tower", has_images ? 1 : 0}}});
//
//   // Training loop, right before the microbatch: normally already decided (a map lookup).
//   auto d = (*worker)->GetDecision({step, mb}, absl::Seconds(30));
//   if (!d.ok()) { /* ABORTED: group failed (names the rank); UNAVAILABLE: coordinator lost */ }
//
// Contract: every rank of a shard group reports the same microbatches in increasing
// (step, microbatch) order; the coordinator gives all of them the identical decision.
//
// Thread-safety: all methods may be called from any thread, concurrently. The worker runs
// two background threads for its session (stream reader; writer that batches plans and
// sends heartbeats), and each Gloo communicator one more for its operations.
// No call blocks longer than its timeout; ReportPlan never blocks on the network.
//
// Reconnect: when the session stream ends with UNAVAILABLE (the coordinator was killed,
// restarts or cannot be reached), the worker reconnects with backoff for
// WorkerOptions::reconnect_window and resumes with the new coordinator process (DESIGN 12):
// decisions it holds are answered and plans are queued meanwhile, communicators stay open.
// When the window passes, or when the coordinator ended the session itself (this rank
// declared dead, a resume refused), every pending and later call fails (UNAVAILABLE, or the
// refusal's code) with a message naming the coordinator and the cause, and open
// communicators are aborted. Create a new Worker to register again; the rank's group
// re-forms under a new epoch once all its members are back.
//
// Logging goes to the "shardcoord.worker" spdlog logger (stderr); the library never
// touches the process's default logger. SHARDCOORD_LOG_LEVEL sets the level.
#ifndef SHARDCOORD_WORKER_H_
#define SHARDCOORD_WORKER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "shardcoord/communicator.h"
#include "shardcoord/cost.h"
#include "shardcoord/export.h"
#include "shardcoord/types.h"

namespace shardcoord {

// Environment variable consulted when WorkerOptions::coordinator_address is empty.
inline constexpr char kCoordinatorAddressEnv[] = "SHARDCOORD_ADDR";
inline constexpr char kTokenEnv[] = "SHARDCOORD_TOKEN";
inline constexpr char kTokenFileEnv[] = "SHARDCOORD_TOKEN_FILE";

// The token to present to a coordinator that requires one (DESIGN 13): `explicit_token` if
// set, else $SHARDCOORD_TOKEN, else the first line of the file $SHARDCOORD_TOKEN_FILE names,
// else "" (none). NOT_FOUND when that file cannot be read.
SHARDCOORD_EXPORT absl::StatusOr<std::string> ResolveToken(const std::string& explicit_token);

inline constexpr char kTlsCaEnv[] = "SHARDCOORD_TLS_CA";
inline constexpr char kTlsCertEnv[] = "SHARDCOORD_TLS_CERT";
inline constexpr char kTlsKeyEnv[] = "SHARDCOORD_TLS_KEY";
inline constexpr char kTlsServerNameEnv[] = "SHARDCOORD_TLS_SERVER_NAME";

// TLS to a coordinator that serves it (DESIGN 13). A CA file turns TLS on: the coordinator's
// certificate must be signed by it and name the host dialled (or `server_name`). A certificate
// and key are presented to a coordinator that requires client certificates (mutual TLS).
// The files are read at each (re)connection, so renewed ones are picked up.
struct TlsFiles {
  std::string ca_file;      // PEM CA bundle; empty: plaintext.
  std::string cert_file;    // PEM client certificate chain (mutual TLS), with key_file.
  std::string key_file;     // PEM private key of cert_file.
  std::string server_name;  // Name to check the certificate against instead of the address's host.

  bool enabled() const { return !ca_file.empty(); }
};

// `explicit_files` with each empty field taken from $SHARDCOORD_TLS_CA, $SHARDCOORD_TLS_CERT,
// $SHARDCOORD_TLS_KEY and $SHARDCOORD_TLS_SERVER_NAME.
SHARDCOORD_EXPORT TlsFiles ResolveTls(const TlsFiles& explicit_files);
inline constexpr absl::Duration kDefaultConnectTimeout = absl::Seconds(30);
inline constexpr absl::Duration kDefaultReconnectWindow = absl::Seconds(30);
// How often at most a worker sends its cost report (Worker::ReportCosts): the coordinator
// recomputes its group's cost model from each, so a large group's reports stay cheap.
inline constexpr absl::Duration kCostReportInterval = absl::Seconds(5);
// How long Close waits for the coordinator to end the session after the goodbye. Normally
// milliseconds; the bound matters when the coordinator is paused: a session cancelled before
// the coordinator read the goodbye counts as a death (its group fails), so it is generous.
inline constexpr absl::Duration kDefaultCloseTimeout = absl::Seconds(10);

struct WorkerOptions {
  std::string coordinator_address;  // HOST:PORT; empty: $SHARDCOORD_ADDR.
  std::string job_id;               // Same on every rank of the job.
  int rank = -1;
  int world_size = 0;
  int group_size = 0;               // Shard groups are contiguous blocks of this many ranks.
  std::vector<ModuleSpec> modules;  // Controlled modules; same on every rank of a group.
  Policy policy = Policy::kUnspecified;        // Unspecified: the coordinator's default.
  Fallback fallback = Fallback::kUnspecified;  // Unspecified: the coordinator's default.
  bool wrap_outer_model = true;
  int lookahead = 0;                // Undecided plans allowed in flight; 0: default (4).
  int64_t memory_budget_bytes = 0;  // For `auto` promotion; 0: unknown (no promotion).
  absl::Duration connect_timeout = kDefaultConnectTimeout;
  // When the session with the coordinator is lost (the daemon died or restarts), the
  // worker reconnects with backoff for this long and resumes (DESIGN 12): decisions it
  // holds stay usable meanwhile, communicators are not aborted. Only when the window
  // passes do pending calls fail, saying so. Zero: fail at once, without reconnecting.
  absl::Duration reconnect_window = kDefaultReconnectWindow;
  // Presented as `authorization: Bearer <token>` on every call (a role `rank` token); empty:
  // ResolveToken's environment variables, else none.
  std::string token;
  // TLS files; each empty field: ResolveTls's environment variables, else plaintext.
  TlsFiles tls;
};

// What registration established.
struct GroupInfo {
  int group = 0;
  std::vector<int> ranks;  // Members, ascending.
  int64_t epoch = 0;
  Policy policy = Policy::kUnspecified;  // Effective.
  Fallback fallback = Fallback::kUnspecified;
  int lookahead = 0;
  absl::Duration heartbeat_interval;
  std::vector<std::string> warnings;
};

class SHARDCOORD_EXPORT Worker {
 public:
  // Connects, registers and starts the background threads, within connect_timeout.
  // Errors: INVALID_ARGUMENT (options incomplete), UNAVAILABLE (coordinator unreachable),
  // DEADLINE_EXCEEDED, or the coordinator's registration error (INVALID_ARGUMENT,
  // FAILED_PRECONDITION, ALREADY_EXISTS) with its message.
  static absl::StatusOr<std::unique_ptr<Worker>> Connect(WorkerOptions options);

  ~Worker();  // Close()s if still open.
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // The group as of registration; `epoch` is updated when the group re-forms.
  GroupInfo group() const;

  // Queues the plan for the coordinator; never blocks on the network. Checked locally
  // first, with the coordinator's codes: INVALID_ARGUMENT (negative step, microbatch or
  // calls; unknown module), FAILED_PRECONDITION (not after the previous plan),
  // RESOURCE_EXHAUSTED (lookahead window full: GetDecision the oldest first), ABORTED
  // (the group failed and has not re-formed), UNAVAILABLE (session lost).
  absl::Status ReportPlan(const MicrobatchPlan& plan);

  // The group's decision for `key`, waiting at most `timeout`. Errors: FAILED_PRECONDITION
  // (no plan was reported for key, or the microbatch can never be decided and why),
  // the coordinator's rejection of the plan, ABORTED (the group failed: names the rank
  // and the cause), UNAVAILABLE (session lost), DEADLINE_EXCEEDED.
  absl::StatusOr<MicrobatchDecision> GetDecision(const MicrobatchKey& key,
                                                 absl::Duration timeout);

  // Reports this rank's frozen-parameter memory per controlled module (e.g. the LibTorch
  // executor's MemoryUsage()); sent with the next heartbeat, shown by `shardctl ranks`.
  // Never blocks.
  void ReportMemory(const std::vector<ModuleMemoryUsage>& usage);

  // Reports what the controlled modules cost on this rank (medians of recent microbatches:
  // forward seconds per call, each unit's all-gather) and, when measured, the bytes frozen
  // modules may hold at once here (0: not measured). The coordinator's cost-aware `auto`
  // decides by the slowest member's numbers (DESIGN 3). Sent at once, at most once per
  // kCostReportInterval (the latest report wins), ahead of any plan reported after it: a
  // report made before the first plan is in force when the group decides that plan (every
  // member's, when each reports before planning). Never blocks.
  void ReportCosts(const std::vector<ModuleCost>& costs, int64_t frozen_budget_bytes = 0);

  // Plans reported whose decision has not arrived yet.
  int UndecidedPlans() const;

  // OK while the session is usable; otherwise why it is not.
  absl::Status Health() const;

  // Health(), and also ABORTED once a rank of another shard group of this job was declared
  // dead (the message names it): collectives that span groups, such as the data-parallel
  // gradient reduction, cannot complete. Stays so for the rest of the session: a trainer
  // whose cross-group process groups include the lost rank must rebuild them or stop.
  absl::Status JobHealth() const;

  // Waits until the group is usable again after a failure (it re-formed under a new
  // epoch), at most `timeout`. OK at once when the group has not failed. Errors:
  // DEADLINE_EXCEEDED (still failed: the message says why), UNAVAILABLE (session lost).
  absl::Status AwaitGroupReady(absl::Duration timeout);

  // Joins a communicator (DESIGN 4) and connects its members (Gloo over TCP on CPU, or NCCL):
  // the coordinator is the rendezvous for (job, name, epoch). Joins the current epoch, or
  // the next one after an abort, waiting up to options.join_timeout for every member to
  // be live. Every member must call it. Errors: FAILED_PRECONDITION (not a member; ranks
  // differ from the communicator's), ABORTED (the epoch was aborted while connecting),
  // DEADLINE_EXCEEDED (members still missing, named), UNAVAILABLE (session lost).
  absl::StatusOr<std::shared_ptr<Communicator>> OpenCommunicator(const CommunicatorOptions& options);

  // Says goodbye (a clean leave: the rank becomes LEFT, not dead) and stops the
  // background threads, within `timeout`. Idempotent.
  void Close(absl::Duration timeout = kDefaultCloseTimeout);
  // The same, with the reason operators and the other ranks see ("left cleanly: REASON"):
  // a trainer that stops on an error says which, so that the ranks it leaves behind name
  // the first cause instead of "rank N declared dead: session stream lost".
  void Close(const std::string& reason, absl::Duration timeout = kDefaultCloseTimeout);
  // The trainer stops on an error: the rank is recorded failed (dead, reason "failed: ERROR"),
  // not left, and its group fails at once naming the rank and `error` (the other ranks' next
  // GetDecision raises it), instead of waiting for plans that will not come. Then as Close.
  void Fail(const std::string& error, absl::Duration timeout = kDefaultCloseTimeout);

  class Impl;

 private:
  explicit Worker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardcoord

#endif  // SHARDCOORD_WORKER_H_
