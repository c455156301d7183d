#include "coordinator/ops/metrics.h"

#include <dirent.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "coordinator/core/daemon_metrics.h"
#include "shardcoord/proto/convert.h"

namespace shardcoord::coordinator {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<ClientMetric::Label>;

class Families {
 public:
  MetricFamily& Family(const std::string& name, const std::string& help, MetricType type) {
    auto [it, fresh] = index_.emplace(name, families_.size());
    if (fresh) families_.push_back(MetricFamily{name, help, type, {}});
    return families_[it->second];
  }
  void Gauge(const std::string& name, const std::string& help, Labels labels, double value) {
    ClientMetric m;
    m.label = std::move(labels);
    m.gauge.value = value;
    Family(name, help, MetricType::Gauge).metric.push_back(std::move(m));
  }
  void Counter(const std::string& name, const std::string& help, Labels labels, double value) {
    ClientMetric m;
    m.label = std::move(labels);
    m.counter.value = value;
    Family(name, help, MetricType::Counter).metric.push_back(std::move(m));
  }
  std::vector<MetricFamily>& all() { return families_; }

 private:
  std::vector<MetricFamily> families_;
  std::map<std::string, size_t> index_;
};

template <typename Enum>
std::vector<std::string> StateNames(const google::protobuf::EnumDescriptor* d) {
  std::vector<std::string> names;
  for (int i = 0; i < d->value_count(); ++i) {
    if (d->value(i)->number() != 0) names.push_back(StateName(static_cast<Enum>(d->value(i)->number())));
  }
  return names;
}

// The (job, name) pairs given series of their own: the first `max` asked for; the others are
// summed under "_other" (names are the client's: without the bound, 100 jobs of 1024 modules
// made an 821,913-series answer).
class LabelFold {
 public:
  static constexpr char kOther[] = "_other";
  explicit LabelFold(int max) : max_(static_cast<size_t>(std::max(max, 0))) {}
  std::string operator()(const std::string& job, const std::string& name) {
    std::pair<std::string, std::string> key(job, name);
    if (admitted_.count(key) > 0) return name;
    if (admitted_.size() < max_) {
      admitted_.insert(std::move(key));
      return name;
    }
    folded_.insert(std::move(key));
    return kOther;
  }
  size_t folded() const { return folded_.size(); }

 private:
  size_t max_;
  std::set<std::pair<std::string, std::string>> admitted_, folded_;
};

struct Folds {
  explicit Folds(int max) : modules(max), comms(max) {}
  LabelFold modules, comms;
};

using StateCounts = std::map<std::string, std::map<std::string, int>>;  // job -> state -> how many

// Every state of every job held, at zero: a series for each, whether or not anything is in it.
StateCounts ZeroStates(const v1::StatusResponse& status, const std::vector<std::string>& states) {
  StateCounts out;
  for (const auto& j : status.jobs()) {
    for (const auto& st : states) out[j.job_id()][st] = 0;
  }
  return out;
}

void Daemon(Families& f, const Snapshot& s) {
  const v1::StatusResponse& st = s.status;
  f.Gauge("shardcoord_build_info", "shardcoord version, always 1", {{"version", st.version()}}, 1);
  f.Gauge("shardcoord_start_time_seconds", "When this daemon started, Unix time", {}, st.started_unix_ms() / 1000.0);
  f.Gauge("shardcoord_incarnation", "This daemon process's incarnation (increases at each restart)", {},
          static_cast<double>(st.incarnation()));
  f.Gauge("shardcoord_jobs", "Jobs held", {}, st.jobs_size());
  f.Gauge("shardcoord_recovering_groups", "Groups waiting for members to resume after a restart", {},
          st.recovering_groups());
  if (s.daemon == nullptr) return;  // A view limited to one job: nothing about the others.
  f.Gauge("shardcoord_buffered_bytes", "Memory held for clients (queued messages, resumes), charged to max_buffered_bytes",
          {}, static_cast<double>(s.buffered_bytes));
  f.Gauge("shardcoord_buffered_bytes_limit", "max_buffered_bytes", {}, static_cast<double>(s.buffered_bytes_limit));
}

void Jobs(Families& f, const v1::StatusResponse& s) {
  for (const auto& j : s.jobs()) {
    const std::string& job = j.job_id();
    f.Gauge("shardcoord_job_world_size", "Ranks in the job", {{"job_id", job}}, j.world_size());
    for (const auto& [state, n] : std::vector<std::pair<const char*, int>>{
             {"live", j.ranks_live()}, {"dead", j.ranks_dead()}, {"left", j.ranks_left()},
             {"unregistered", j.ranks_unregistered()}}) {
      f.Gauge("shardcoord_ranks", "Ranks by state", {{"job_id", job}, {"state", state}}, n);
    }
    f.Counter("shardcoord_plans_received_total", "Microbatch plans received from the job's ranks", {{"job_id", job}},
              static_cast<double>(j.plans_received()));
    f.Counter("shardcoord_microbatches_decided_total", "Microbatches decided", {{"job_id", job}},
              static_cast<double>(j.microbatches_decided()));
  }
}

// Jobs whose per-rank and per-group series are given (at most `max` ranks): the others get
// per-job series only, so series stay few for a 16k-rank job.
std::set<std::string> DetailedJobs(const v1::StatusResponse& status, int max) {
  std::set<std::string> out;
  for (const auto& j : status.jobs()) {
    if (j.world_size() <= max) out.insert(j.job_id());
  }
  return out;
}

void ModuleCounts(Families& f, const std::string& job, const std::string& module, const v1::DecisionCounts& c) {
  const Labels base = {{"job_id", job}, {"module", module}};
  for (Decision kind : kDecisions) {  // Every kind of decisions.def, zero included.
    Labels l = base;
    l.push_back({"decision", DecisionName(kind)});
    f.Counter("shardcoord_module_decisions_total", "Module decisions given, by module and kind, summed over the "
              "job's groups", std::move(l), static_cast<double>(CountOf(c, kind)));
  }
  f.Counter("shardcoord_divergent_decisions_total", "Module decisions made because a group's plans diverged",
            base, static_cast<double>(c.divergent()));
}

void Groups(Families& f, const Snapshot& s, const std::set<std::string>& detailed, LabelFold& fold) {
  static const std::vector<std::string> kStates = StateNames<v1::GroupState>(v1::GroupState_descriptor());
  StateCounts by_state = ZeroStates(s.status, kStates);  // job -> state -> groups
  std::map<std::string, std::map<std::string, v1::DecisionCounts>> by_module;  // job -> module -> counts
  std::map<std::string, int64_t> pending;  // job -> microbatches
  for (const auto& j : s.status.jobs()) pending[j.job_id()] = 0;
  for (const auto& g : s.groups.groups()) {
    by_state[g.job_id()][StateName(g.state())]++;
    pending[g.job_id()] += g.pending_microbatches();
    for (const auto& [module, c] : g.module_counts()) AddDecisionCounts(c, &by_module[g.job_id()][module]);
    if (detailed.count(g.job_id()) == 0) continue;
    const Labels l = {{"job_id", g.job_id()}, {"group", std::to_string(g.group())}};
    f.Gauge("shardcoord_group_epoch", "The group's epoch (increases when it re-forms; jobs of at most "
            "metrics_rank_series_max ranks)", l, static_cast<double>(g.epoch()));
    f.Gauge("shardcoord_group_pending_microbatches", "Microbatches some members of the group planned and others not "
            "yet (jobs of at most metrics_rank_series_max ranks)", l, g.pending_microbatches());
  }
  for (const auto& [job, states] : by_state) {
    for (const auto& [state, n] : states) {
      f.Gauge("shardcoord_groups", "Shard groups by state", {{"job_id", job}, {"state", state}}, n);
    }
  }
  for (const auto& [job, n] : pending) {
    f.Gauge("shardcoord_pending_microbatches", "Microbatches some members of a group planned and others not yet, "
            "summed over the job's groups", {{"job_id", job}}, static_cast<double>(n));
  }
  for (const auto& [job, modules] : by_module) {
    std::map<std::string, v1::DecisionCounts> folded;
    for (const auto& [module, c] : modules) AddDecisionCounts(c, &folded[fold(job, module)]);
    for (const auto& [module, c] : folded) ModuleCounts(f, job, module, c);
  }
}

// Per job: the rank counters summed (as doubles: a hostile rank's huge report cannot overflow
// them), the stalest heartbeat and frozen memory by module; per rank (heartbeat age) only for
// detailed jobs.
struct RankSums {
  double oldest = 0, rejected = 0, registrations = 0, stalls = 0, stall_us = 0;
  std::map<std::string, std::pair<double, double>> memory;  // module -> (max peak, gathered total)
};

void PerJobRankSeries(Families& f, const std::string& job, const RankSums& pj, LabelFold& fold) {
  const Labels l = {{"job_id", job}};
  f.Gauge("shardcoord_heartbeat_age_max_seconds", "Time since the least recent message (heartbeat, plans, "
          "communicator call) of a live rank (0: none live)", l, pj.oldest);
  f.Counter("shardcoord_plans_rejected_total", "Plans the daemon rejected (malformed, out of order, outside the "
            "window), summed over the job's ranks", l, pj.rejected);
  f.Counter("shardcoord_rank_registrations_total", "Registrations of the job's ranks (first, rejoins after a "
            "death, resumes after a reconnect)", l, pj.registrations);
  f.Counter("shardcoord_decision_stalls_total", "Times a trainer asked for a decision not yet in its lookahead "
            "window and waited, summed over the job's ranks (their heartbeats report it)", l, pj.stalls);
  f.Counter("shardcoord_decision_stall_seconds_total", "Time trainers waited for decisions, summed over the job's "
            "ranks", l, pj.stall_us / 1e6);
  std::map<std::string, std::pair<double, double>> folded;
  for (const auto& [module, mem] : pj.memory) {
    auto& into = folded[fold(job, module)];
    into.first = std::max(into.first, mem.first);
    into.second += mem.second;
  }
  for (const auto& [module, mem] : folded) {
    const Labels lm = {{"job_id", job}, {"module", module}};
    f.Gauge("shardcoord_frozen_peak_bytes", "Highest frozen-parameter memory of the module on any rank, as the "
            "trainers report it", lm, mem.first);
    f.Counter("shardcoord_gathered_bytes_total", "Bytes of the module materialized by all-gathers, summed over "
              "the job's ranks, as the trainers report them", lm, mem.second);
  }
}

void Ranks(Families& f, const Snapshot& s, const std::set<std::string>& detailed, LabelFold& fold) {
  std::map<std::string, RankSums> jobs;
  for (const auto& j : s.status.jobs()) jobs[j.job_id()];
  for (const auto& r : s.ranks.ranks()) {
    RankSums& pj = jobs[r.job_id()];
    pj.rejected += static_cast<double>(r.plans_rejected());
    pj.registrations += static_cast<double>(r.registrations());
    pj.stalls += static_cast<double>(r.decision_stalls());
    pj.stall_us += static_cast<double>(r.decision_stall_us());
    for (const auto& m : r.memory()) {
      auto& peak = pj.memory[m.module()].first;
      peak = std::max(peak, static_cast<double>(m.peak_bytes()));
    }
    for (const auto& [module, bytes] : r.gathered_bytes_total()) {
      pj.memory[module].second += static_cast<double>(bytes);
    }
    if (r.state() != v1::RANK_STATE_LIVE) continue;
    const double age = r.last_heartbeat_age_ms() / 1000.0;
    pj.oldest = std::max(pj.oldest, age);
    if (detailed.count(r.job_id()) > 0) {
      f.Gauge("shardcoord_rank_heartbeat_age_seconds", "Time since a live rank's last message (jobs of at most "
              "metrics_rank_series_max ranks)", {{"job_id", r.job_id()}, {"rank", std::to_string(r.rank())}}, age);
    }
  }
  for (const auto& [job, pj] : jobs) PerJobRankSeries(f, job, pj, fold);
}

void Comms(Families& f, const Snapshot& s, LabelFold& fold) {
  static const std::vector<std::string> kStates = StateNames<v1::CommState>(v1::CommState_descriptor());
  StateCounts by_state = ZeroStates(s.status, kStates);  // job -> state -> communicators
  std::map<std::pair<std::string, std::string>, std::pair<double, double>> by_comm;  // -> (max epoch, aborts)
  for (const auto& c : s.comms.comms()) {
    by_state[c.job_id()][StateName(c.state())]++;
    auto& into = by_comm[{c.job_id(), fold(c.job_id(), c.name())}];
    into.first = std::max(into.first, static_cast<double>(c.epoch()));
    into.second += static_cast<double>(c.epochs_aborted());
  }
  for (const auto& [key, v] : by_comm) {
    const Labels l = {{"job_id", key.first}, {"comm", key.second}};
    f.Gauge("shardcoord_communicator_epoch", "A named communicator's epoch (\"_other\": the highest of the job's "
            "communicators past metrics_labels_max)", l, v.first);
    f.Counter("shardcoord_communicator_aborts_total", "Epochs of the communicator that ended in an abort", l, v.second);
  }
  for (const auto& [job, states] : by_state) {
    for (const auto& [state, n] : states) {
      f.Gauge("shardcoord_communicators", "Named communicators by state", {{"job_id", job}, {"state", state}}, n);
    }
  }
}

// The standard process series (names as Prometheus' client libraries export them), from /proc.
void Process(Families& f) {
  std::ifstream stat("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');  // The command name may hold spaces.
  if (paren == std::string::npos || paren + 2 > text.size()) return;
  std::istringstream in(text.substr(paren + 2));
  std::vector<double> field;  // field[0] is stat's 4th field (ppid): stat field N is field[N - 4].
  std::string word;
  in >> word;  // The state, a letter.
  for (double v = 0; in >> word && absl::SimpleAtod(word, &v);) field.push_back(v);
  if (field.size() < 21) return;  // Not the /proc we know: no process series rather than wrong ones.
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  f.Counter("process_cpu_seconds_total", "User and system CPU time spent, seconds", {},
            (field[10] + field[11]) / ticks);
  f.Gauge("process_threads", "Threads of the process", {}, field[16]);
  f.Gauge("process_virtual_memory_bytes", "Virtual memory size", {}, field[19]);
  f.Gauge("process_resident_memory_bytes", "Resident memory size", {}, field[20] * page);
  std::ifstream proc_stat("/proc/stat");
  for (std::string key; proc_stat >> key;) {
    if (key == "btime") {
      double boot = 0;
      proc_stat >> boot;
      f.Gauge("process_start_time_seconds", "When the process started, Unix time", {}, boot + field[18] / ticks);
      break;
    }
  }
  int fds = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (const dirent* e = readdir(d)) fds += e->d_name[0] != '.';
    closedir(d);
    f.Gauge("process_open_fds", "Open file descriptors", {}, fds - 1);  // Less the one reading the folder.
  }
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0) {
    f.Gauge("process_max_fds", "Limit on open file descriptors (RLIMIT_NOFILE)", {}, static_cast<double>(lim.rlim_cur));
  }
}

}  // namespace

std::string MetricsText(const Snapshot& snapshot) {
  Families f;
  Daemon(f, snapshot);
  Jobs(f, snapshot.status);
  const std::set<std::string> detailed = DetailedJobs(snapshot.status, snapshot.rank_series_max);
  Folds folds(snapshot.labels_max);
  Groups(f, snapshot, detailed, folds.modules);
  Ranks(f, snapshot, detailed, folds.modules);
  Comms(f, snapshot, folds.comms);
  for (const auto& [kind, n] : {std::pair<const char*, size_t>{"module", folds.modules.folded()},
                                {"comm", folds.comms.folded()}}) {
    f.Gauge("shardcoord_metrics_folded_labels", "(job, module) or (job, communicator) pairs summed under \"_other\" "
            "in this answer: past metrics_labels_max", {{"kind", kind}}, static_cast<double>(n));
  }
  if (snapshot.process) Process(f);
  if (snapshot.daemon != nullptr) snapshot.daemon->AppendTo(&f.all());
  return prometheus::TextSerializer().Serialize(f.all());
}

}  // namespace shardcoord::coordinator
