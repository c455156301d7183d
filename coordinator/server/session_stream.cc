// The rank Session streams: one SessionCall per stream feeding CoordinatorCore, a bounded
// outbox per session (SessionSink), N completion queues with a thread each (DESIGN 9).
#include "coordinator/server/session_stream.h"

#include <system_error>

#include <algorithm>
#include <atomic>
#include <deque>
#include <iterator>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "coordinator/core/decision_wire.h"
#include "coordinator/server/auth.h"
#include "coordinator/server/wire_intake.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpc/slice.h"
#include "grpcpp/alarm.h"
#include "shardcoord/internal/logging.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {
namespace {

// Whether `msg` is of a kind that is reserved in WorkerMessage (2, 3, 5: plans, heartbeat and
// acknowledgement alone, retired before 0.1.0). An older worker is refused at registration (its
// wire revision); a client that registers at this revision and sends one anyway is broken, and
// would otherwise be ignored silently (an unknown kind), waiting for decisions forever.
bool SentRetiredKind(const v1::WorkerMessage& msg) {
  const google::protobuf::UnknownFieldSet& unknown = msg.GetReflection()->GetUnknownFields(msg);
  for (int i = 0; i < unknown.field_count(); ++i) {
    const int number = unknown.field(i).number();
    if (number == 2 || number == 3 || number == 5) return true;
  }
  return false;
}
constexpr char kRetiredKind[] =
    "this client sent plans, heartbeats or abort acknowledgements one kind per message (WorkerMessage fields 2, 3, "
    "5, retired before 0.1.0), which no worker of its wire revision does; send them in a WorkerMessage.bundle";

}  // namespace

struct SessionStreams::Shared {
  CoordinatorCore* core;
  CoordinatorServiceBase* service;
  Authorize authorize;
  std::atomic<uint64_t> next_session{1};
  std::atomic<int> calls{0};  // SessionCall objects alive (awaited streams included).
  absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;  // No new stream is awaited.
};

namespace {

// Consecutive decision messages queued for a rank are written as one message, up to a
// count and a size (a decision lists every module: a big manifest makes big decisions, and
// the worker's receive limit is kWorkerMaxReceiveBytes, see worker.cc). The size bounds a merge,
// not one batch the core queued: the core queues at most one operation's decisions at a time.
constexpr int kMaxDecisionsPerWrite = 256;
constexpr size_t kMaxBytesPerWrite = 1 << 20;

class SessionCall;

// The RankSink of one session: a write queue in front of its stream. The core may call it
// after the stream is gone; it then drops messages. Thread-safe.
// A write in flight for less than this does not make its rank a non-reader.
constexpr absl::Duration kReadingGrace = absl::Seconds(1);

class SessionSink final : public RankSink {
 public:
  SessionSink(SessionCall* call, int64_t max_bytes, std::shared_ptr<BufferBudget> budget, uint64_t incarnation)
      : call_(call), max_bytes_(max_bytes), budget_(std::move(budget)), incarnation_(incarnation) {}
  ~SessionSink() override {
    absl::MutexLock lock(&mu_);
    budget_->Give(charged_);
  }

  // Queues only (the core calls it under its mutex); refuses once more than max_bytes are
  // queued, or the daemon's buffers are full and this rank holds more than a short queue:
  // the rank does not read.
  absl::Status Send(v1::CoordinatorMessage msg) override;
  // Queues them as one message, or adds them to the decisions queued last, up to the bounds of
  // one write: the decisions' bytes are written as they are (decision_wire.h).
  absl::Status SendDecisions(std::vector<EncodedDecision> batch) override;
  // Starts the write of what is queued (the core calls it after unlocking).
  void Kick() override {
    absl::MutexLock lock(&mu_);
    if (!writing_) StartNextLocked();
  }
  void Close(const absl::Status& status) override;
  Backlog backlog() const override {
    absl::MutexLock lock(&mu_);
    return {charged_, writing_ ? write_started_ : absl::InfiniteFuture()};
  }
  void CutForNotReading() override {
    absl::MutexLock lock(&mu_);
    overflowed_ = true;  // Close drops the queue and cancels the stuck write.
  }
  void OnWriteDone(bool ok);
  // The stream is over: nothing more is written. Operations started before stay counted
  // by the call (SessionCall::BeginOp runs under mu_).
  void Detach() {
    absl::MutexLock lock(&mu_);
    call_ = nullptr;
  }

 private:
  // Starts the next write or the finish, if nothing is in flight.
  void StartNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a new message's share of the bounds (its wire size, and its cost for the daemon's
  // buffers, which it returns), or says why not: the rank does not read.
  absl::StatusOr<int64_t> AdmitLocked(size_t wire_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  SessionCall* call_ ABSL_GUARDED_BY(mu_);
  // A message waiting to be written: decisions (their bytes, shared with the other members'
  // queues), or any other message.
  struct Queued {
    std::vector<EncodedDecision> decisions;  // Empty: `message` is the one to write.
    v1::CoordinatorMessage message;
    size_t wire_bytes = 0;  // As queued (without the incarnation, which the write adds).
    int64_t cost = 0;       // Taken from budget_ for it.
  };
  // Gives back what `q` was charged.
  void DequeuedLocked(const Queued& q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    queued_bytes_ -= static_cast<int64_t>(q.wire_bytes);
    charged_ -= q.cost;
    budget_->Give(q.cost);
  }
  // Drops what is queued (nothing more will be written) and gives back all it was charged.
  void DropQueueLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    queue_.clear();
    queued_bytes_ = 0;
    budget_->Give(charged_);
    charged_ = 0;
  }

  const int64_t max_bytes_;
  const std::shared_ptr<BufferBudget> budget_;
  const uint64_t incarnation_;  // Stamped on every message (DESIGN 12).
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;   // Wire bytes in queue_.
  int64_t charged_ ABSL_GUARDED_BY(mu_) = 0;        // Taken from budget_ for queue_.
  bool overflowed_ ABSL_GUARDED_BY(mu_) = false;  // A Send was refused.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time write_started_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();  // Of the write in flight.
  std::optional<grpc::Status> finish_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer current_ ABSL_GUARDED_BY(mu_);  // Owned by the write in flight.
};

// What a completion-queue tag stands for: one operation of one call.
struct Tag {
  enum Op { kAccepted, kRead, kWrite, kFinish, kDone, kRegisterDeadline };
  SessionCall* call;
  Op op;
};

// One Session stream, from the request for it to its end. Its completions arrive on one
// queue, drained by one thread, so they never run concurrently; writes and the finish are
// started from any thread, through the sink. The call deletes itself once the stream is
// done and no operation it started is outstanding.
class SessionCall {
 public:
  SessionCall(std::shared_ptr<SessionStreams::Shared> shared, grpc::ServerCompletionQueue* cq)
      : shared_(std::move(shared)), cq_(cq), stream_(&ctx_) {
    shared_->calls.fetch_add(1);
    // Only delivered for a call that started: a request failed at shutdown gets no kDone.
    ctx_.AsyncNotifyWhenDone(&done_tag_);
    ops_ = 1;  // The request.
    shared_->service->RequestSession(&ctx_, &stream_, cq_, cq_, &accepted_tag_);
  }

  ~SessionCall() { shared_->calls.fetch_sub(1); }

  // Awaits the next stream on `cq`, unless the streams stop.
  static void Await(const std::shared_ptr<SessionStreams::Shared>& shared, grpc::ServerCompletionQueue* cq) {
    absl::MutexLock lock(&shared->mu);
    if (!shared->stopping) new SessionCall(shared, cq);
  }

  // One completion of this call; may delete it.
  void Proceed(Tag::Op op, bool ok) {
    switch (op) {
      case Tag::kAccepted:
        if (!ok) {  // The server shuts down: no stream, and no kDone to wait for.
          delete this;
          return;
        }
        Await(shared_, cq_);
        OnAccepted();
        break;
      case Tag::kRead:
        OnRead(ok);
        break;
      case Tag::kWrite:
        sink_->OnWriteDone(ok);
        break;
      case Tag::kFinish:
        break;
      case Tag::kRegisterDeadline:
        // ok: it fired; not ok: cancelled (registered, or the stream is done).
        if (ok && !registered_) {
          sink_->Close(absl::DeadlineExceededError(absl::StrCat(
              "no `register` within ", absl::FormatDuration(shared_->core->options().limits.handshake_timeout),
              " of opening the Session stream; send a RegisterRequest first (handshake_timeout_ms)")));
        }
        break;
      case Tag::kDone:
        OnDone();
        return;  // Not an operation of ours: nothing to count.
    }
    EndOp();
  }

  // For the sink: called with the sink's mutex held, so that a detached sink starts nothing.
  void StartWrite(const grpc::ByteBuffer* msg) {
    BeginOp();
    stream_.Write(*msg, &write_tag_);
  }
  void Finish(const grpc::Status& status) {
    BeginOp();
    stream_.Finish(status, &finish_tag_);
  }
  // Ends the stream now, failing the write in flight (a rank that does not read would hold
  // it, its message and the stream's buffers until it went away).
  void Cancel() { ctx_.TryCancel(); }

 private:
  void OnAccepted() {
    id_ = shared_->next_session.fetch_add(1);
    peer_ = ctx_.peer();
    CoordinatorCore* core = shared_->core;
    sink_ = std::make_shared<SessionSink>(this, core->options().limits.max_outbox_bytes, core->buffers(),
                                          core->incarnation());
    auto scope = shared_->authorize(&ctx_);
    if (!scope.ok()) {
      sink_->Close(scope.status());
      return;
    }
    job_scope_ = *std::move(scope);
    // A stream that never registers holds a descriptor and a call: closed at a deadline.
    BeginOp();
    register_deadline_.Set(cq_, absl::ToChronoTime(absl::Now() + core->options().limits.handshake_timeout),
                           &register_deadline_tag_);
    Read();
  }

  void Read() {
    BeginOp();
    stream_.Read(&in_bytes_, &read_tag_);
  }
  // What was read, parsed into `arena` (nullptr: it does not parse).
  v1::WorkerMessage* ParseIn(google::protobuf::Arena* arena) {
    auto* in = google::protobuf::Arena::CreateMessage<v1::WorkerMessage>(arena);
    return grpc::SerializationTraits<v1::WorkerMessage>::Deserialize(&in_bytes_, in).ok() ? in : nullptr;
  }

  // The registration, the only message a Session may begin with.
  void OnFirstMessage(const v1::WorkerMessage& in);
  void OnRead(bool ok);
  // A message read after the registration.
  void OnMessage(const v1::WorkerMessage& in);

  void OnDone() {
    if (sink_) sink_->Detach();
    register_deadline_.Cancel();  // Its tag still comes (not ok); the call waits for it.
    shared_->core->OnSessionClosed(
        id_, absl::StrCat("stream from ", peer_, ctx_.IsCancelled() ? " cancelled" : " done"));
    bool last;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      last = ops_ == 0;
    }
    if (last) delete this;
  }

  void BeginOp() {
    absl::MutexLock lock(&mu_);
    ++ops_;
  }
  void EndOp() {
    bool last;
    {
      absl::MutexLock lock(&mu_);
      last = --ops_ == 0 && done_;
    }
    if (last) delete this;
  }

  const std::shared_ptr<SessionStreams::Shared> shared_;
  grpc::ServerCompletionQueue* const cq_;
  grpc::ServerContext ctx_;
  // Raw: the sink writes decisions as the bytes the core encoded once for their whole group
  // (decision_wire.h); what is read is parsed here (ParseIn).
  grpc::ServerAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer> stream_;
  Tag accepted_tag_{this, Tag::kAccepted};
  Tag read_tag_{this, Tag::kRead};
  Tag write_tag_{this, Tag::kWrite};
  Tag finish_tag_{this, Tag::kFinish};
  Tag done_tag_{this, Tag::kDone};
  Tag register_deadline_tag_{this, Tag::kRegisterDeadline};
  grpc::Alarm register_deadline_;
  uint64_t id_ = 0;
  std::string peer_;
  std::string job_scope_;  // The only job this session may register for; "" for any.
  std::shared_ptr<SessionSink> sink_;
  grpc::ByteBuffer in_bytes_;
  bool registered_ = false;
  absl::Mutex mu_;
  int ops_ ABSL_GUARDED_BY(mu_) = 0;  // Started, not yet completed.
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

void SessionCall::OnRead(bool ok) {
  CoordinatorCore* core = shared_->core;
  if (!ok) {
    core->OnSessionClosed(id_, absl::StrCat("stream from ", peer_, " ended"));
    // The client closed its side (a message that does not parse is ParseIn's, below). Before a
    // registration, answered: a stream closed with nothing said is a broken client.
    sink_->Close(registered_ ? absl::OkStatus()
                             : absl::InvalidArgumentError("the Session ended before a `register` was sent: the "
                                                          "first message of a Session must be a RegisterRequest"));
    return;
  }
  // Parsed into an arena whose first block is this thread's scratch: a plan's map, key and strings
  // are bump-allocated and dropped together once the message is handled, not allocated and freed
  // one by one. The message is handled before OnRead returns, and a queue's completions run on its
  // one thread, so the block is never in use twice.
  // (On the heap, made once per thread: 64 KiB of static TLS would not fit a dlopen'ed library.)
  constexpr size_t kScratchBytes = 64 << 10;
  static thread_local const std::unique_ptr<char[]> scratch(new char[kScratchBytes]);
  google::protobuf::ArenaOptions arena_options;
  arena_options.initial_block = scratch.get();
  arena_options.initial_block_size = kScratchBytes;
  google::protobuf::Arena arena(arena_options);
  const v1::WorkerMessage* in = ParseIn(&arena);
  if (in == nullptr) {
    // Before a registration, answered as before one could be read; after, the rank's stream ends
    // with the reason (gRPC's typed reads ended it as a close, OK, with nothing said).
    const std::string why =
        registered_ ? "a message on the Session could not be parsed (every string must be valid UTF-8, and the "
                      "message a WorkerMessage); the stream is closed: the rank must register again"
                    : "the Session's first message could not be parsed (every string must be valid UTF-8, and the "
                      "message a WorkerMessage); send a RegisterRequest";
    sink_->Close(absl::InvalidArgumentError(why));
    if (registered_) core->OnSessionClosed(id_, why);
    return;
  }
  if (!registered_) return OnFirstMessage(*in);
  OnMessage(*in);
}

void SessionCall::OnMessage(const v1::WorkerMessage& in) {
  CoordinatorCore* core = shared_->core;
  if (in.incarnation() != 0 && in.incarnation() != core->incarnation()) {
    const std::string why = absl::StrCat("message meant for coordinator incarnation ", in.incarnation(),
                                         ", but this is incarnation ", core->incarnation(),
                                         ": the coordinator restarted; the worker must resume");
    sink_->Close(absl::FailedPreconditionError(why));
    core->OnSessionClosed(id_, why);
    return;
  }
  switch (in.kind_case()) {
    case v1::WorkerMessage::kBundle:
      core->OnBundle(id_, FromWire(in.bundle()));
      break;
    case v1::WorkerMessage::kGoodbye:
      core->OnGoodbye(id_, in.goodbye().reason(), in.goodbye().failed());
      sink_->Close(absl::OkStatus());
      return;
    case v1::WorkerMessage::kRegister:
      // The client's error first (the core's "declared dead" close then finds it closed).
      sink_->Close(absl::FailedPreconditionError(
          "`register` may only be the first message of a Session; open a new stream to "
          "register again"));
      core->OnSessionClosed(id_, "register sent twice on one stream");
      return;
    default:
      if (SentRetiredKind(in)) {
        sink_->Close(absl::FailedPreconditionError(kRetiredKind));
        core->OnSessionClosed(id_, kRetiredKind);
        return;
      }
      break;  // An empty message (a newer client's unknown kind): ignored.
  }
  Read();
}

void SessionCall::OnFirstMessage(const v1::WorkerMessage& in) {
  if (in.kind_case() != v1::WorkerMessage::kRegister) {
    sink_->Close(absl::FailedPreconditionError(
        "the first message of a Session must be `register`; send a RegisterRequest first"));
    return;
  }
  absl::Status s = Grant{Role::kRank, job_scope_}.AllowsJob(in.register_().job_id(), "register");
  if (s.ok()) s = shared_->core->Register(id_, FromWire(in.register_()), sink_);
  if (!s.ok()) {
    sink_->Close(s);
    return;
  }
  registered_ = true;
  register_deadline_.Cancel();
  Read();
}

absl::StatusOr<int64_t> SessionSink::AdmitLocked(size_t wire_bytes) {
  const int64_t size = static_cast<int64_t>(wire_bytes);
  const int64_t cost = QueuedMessageCost(size);
  if (overflowed_) return absl::ResourceExhaustedError("not reading its session stream");
  if (queued_bytes_ + size > max_bytes_) {
    overflowed_ = true;
    return absl::ResourceExhaustedError(absl::StrCat(
        "not reading its session stream: more than ", max_bytes_,
        " bytes were queued for it (max_outbox_bytes); a rank must keep reading its decisions"));
  }
  if (!budget_->TryTake(cost, charged_)) {
    const absl::Time now = absl::Now();
    if (!writing_ || now - write_started_ < kReadingGrace) {
      // It reads (its last write completed, or is recent): never cut, nor blamed, for bytes
      // others hold. Taken past the limit; the core cuts the holders that do not read.
      budget_->TakeOver(cost);
    } else {
      overflowed_ = true;
      return absl::ResourceExhaustedError(absl::StrCat(
          "not reading its session stream: its write has waited ", absl::ToInt64Milliseconds(now - write_started_),
          " ms for it to read while the daemon's buffers for all clients are full (max_buffered_bytes ",
          budget_->limit(), ") and ", charged_, " bytes of them are queued for this rank; a rank must keep reading "
          "its decisions"));
    }
  }
  queued_bytes_ += size;
  charged_ += cost;
  return cost;
}

absl::Status SessionSink::Send(v1::CoordinatorMessage msg) {
  const size_t size = msg.ByteSizeLong();
  absl::MutexLock lock(&mu_);
  if (call_ == nullptr || finish_.has_value()) return absl::OkStatus();  // Closing: not the rank's fault.
  absl::StatusOr<int64_t> cost = AdmitLocked(size);
  if (!cost.ok()) return cost.status();
  queue_.push_back({{}, std::move(msg), size, *cost});
  return absl::OkStatus();
}

absl::Status SessionSink::SendDecisions(std::vector<EncodedDecision> batch) {
  if (batch.empty()) return absl::OkStatus();
  const size_t size = DecisionsMessageSize(batch, 0);
  absl::MutexLock lock(&mu_);
  if (call_ == nullptr || finish_.has_value()) return absl::OkStatus();  // Closing: not the rank's fault.
  absl::StatusOr<int64_t> cost = AdmitLocked(size);
  if (!cost.ok()) return cost.status();
  if (!queue_.empty()) {
    // Behind decisions not yet written: one write, while it stays within a write's bounds.
    Queued& last = queue_.back();
    if (!last.decisions.empty() && last.decisions.size() + batch.size() <= kMaxDecisionsPerWrite &&
        last.wire_bytes + size <= kMaxBytesPerWrite) {
      last.decisions.insert(last.decisions.end(), std::make_move_iterator(batch.begin()),
                            std::make_move_iterator(batch.end()));
      last.wire_bytes += size;
      last.cost += *cost;
      return absl::OkStatus();
    }
  }
  queue_.push_back({std::move(batch), {}, size, *cost});
  return absl::OkStatus();
}

void SessionSink::Close(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (call_ == nullptr || finish_.has_value()) return;
  finish_ = ToGrpcStatus(status);
  if (overflowed_) {
    // The rank stopped reading: what is queued would only wait behind the stuck write, and
    // the stuck write would hold the stream until the client went away: cancel it.
    DropQueueLocked();
    if (writing_) {
      call_->Cancel();
      return;
    }
  }
  if (!writing_) StartNextLocked();
}

void SessionSink::OnWriteDone(bool ok) {
  absl::MutexLock lock(&mu_);
  writing_ = false;
  current_.Clear();  // Its bytes are not kept until the next write.
  if (!ok) {
    // The stream is broken; nothing more can be written.
    DropQueueLocked();
    if (!finish_) finish_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed");
  }
  StartNextLocked();
}

// Starting an operation on the completion-queue API never runs a completion inline, so
// this may hold mu_ while it does (the callback API's reactions could run inline).
void SessionSink::StartNextLocked() {
  if (call_ == nullptr) return;
  if (!queue_.empty()) {
    Queued& next = queue_.front();
    current_.Clear();  // Serialize fills only an empty buffer.
    grpc::Status serialized;
    if (next.decisions.empty()) {
      next.message.set_incarnation(incarnation_);
      bool own = false;
      serialized = grpc::SerializationTraits<v1::CoordinatorMessage>::Serialize(next.message, &current_, &own);
    } else {
      grpc_slice bytes = grpc_slice_malloc(DecisionsMessageSize(next.decisions, incarnation_));
      WriteDecisionsMessage(next.decisions, incarnation_, GRPC_SLICE_START_PTR(bytes));
      grpc::Slice slice(bytes, grpc::Slice::STEAL_REF);
      grpc::ByteBuffer written(&slice, 1);
      current_.Swap(&written);
    }
    DequeuedLocked(next);
    queue_.pop_front();
    if (serialized.ok()) {
      writing_ = true;
      write_started_ = absl::Now();
      call_->StartWrite(&current_);
      return;
    }
    // Our own message did not serialize (only a bug can do that): the stream ends saying so,
    // rather than a part of what the rank was sent going missing.
    current_.Clear();
    DropQueueLocked();
    finish_ = grpc::Status(grpc::StatusCode::INTERNAL,
                           absl::StrCat("the coordinator could not serialize a message for this rank (",
                                        serialized.error_message(), "); register again"));
  }
  if (finish_.has_value() && !finished_) {
    finished_ = true;
    call_->Finish(*finish_);
  }
}

}  // namespace

SessionStreams::SessionStreams(CoordinatorCore* core, CoordinatorServiceBase* service, Authorize authorize,
                               int threads, grpc::ServerBuilder& builder)
    : shared_(std::make_shared<Shared>()) {
  shared_->core = core;
  shared_->service = service;
  shared_->authorize = std::move(authorize);
  for (int i = 0; i < std::max(1, threads); ++i) queues_.push_back(builder.AddCompletionQueue());
}

SessionStreams::~SessionStreams() {
  if (!stopped_) Stop();
}

absl::Status SessionStreams::Start() {
  // Every thread first: one that cannot be made (1024 of them under a 2 GiB address-space limit)
  // is said, where it aborted the daemon; no stream is awaited on a queue without its thread.
  for (size_t i = 0; i < queues_.size(); ++i) {
    grpc::ServerCompletionQueue* cq = queues_[i].get();
    try {
      threads_.emplace_back([cq] {
        void* tag = nullptr;
        bool ok = false;
        while (cq->Next(&tag, &ok)) {
          auto* t = static_cast<Tag*>(tag);
          t->call->Proceed(t->op, ok);
        }
      });
    } catch (const std::system_error& e) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot start session thread ", i + 1, " of ", queues_.size(), " (", e.what(),
          "): lower session_threads (--session-threads; 0 is one per CPU) or raise the process's thread or "
          "address-space limit"));
    }
  }
  started_ = true;
  for (auto& q : queues_) {
    // Two awaited streams per queue, so that a burst of registrations is accepted quickly.
    SessionCall::Await(shared_, q.get());
    SessionCall::Await(shared_, q.get());
  }
  return absl::OkStatus();
}

void SessionStreams::Stop() {
  stopped_ = true;
  {
    absl::MutexLock lock(&shared_->mu);
    shared_->stopping = true;
  }
  // The server's Shutdown() returned: its calls are cancelled, and each SessionCall deletes
  // itself once its last completion ran. Wait for that while the threads still drain the
  // queues: an operation started on a queue already shut down would abort the process.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (started_ && shared_->calls.load() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  if (started_ && shared_->calls.load() > 0) {
    logging::Get("coordinator")->error("{} session streams still open 10 s after the server stopped; stopping anyway",
                                       shared_->calls.load());
  }
  for (auto& cq : queues_) cq->Shutdown();
  for (auto& t : threads_) t.join();
  threads_.clear();
  if (!started_) {
    // Never served (the server did not start): nothing awaited, drain the empty queues.
    for (auto& cq : queues_) {
      void* tag = nullptr;
      bool ok = false;
      while (cq->Next(&tag, &ok)) {
      }
    }
  }
}

}  // namespace shardcoord::coordinator
