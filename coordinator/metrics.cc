#include "coordinator/metrics.h"

#include <dirent.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "coordinator/daemon_metrics.h"
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

void Daemon(Families& f, const Snapshot& s) {
  const v1::StatusResponse& st = s.status;
  f.Gauge("shardcoord_build_info", "shardcoord version, always 1", {{"version", st.version()}}, 1);
  f.Gauge("shardcoord_start_time_seconds", "When this daemon started, Unix time", {}, st.started_unix_ms() / 1000.0);
  f.Gauge("shardcoord_incarnation", "This daemon process's incarnation (increases at each restart)", {},
          static_cast<double>(st.incarnation()));
  f.Gauge("shardcoord_jobs", "Jobs held", {}, st.jobs_size());
  f.Gauge("shardcoord_recovering_groups", "Groups waiting for members to resume after a restart", {},
          st.recovering_groups());
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

void ModuleCounts(Families& f, const Labels& base, const std::string& module, const v1::DecisionCounts& c) {
  Labels with_module = base;
  with_module.push_back({"module", module});
  for (const auto& [kind, n] : std::vector<std::pair<const char*, int64_t>>{
           {"per_layer", c.per_layer()}, {"skip", c.skip()}, {"root", c.root()}, {"replicate", c.replicate()}}) {
    Labels l = with_module;
    l.push_back({"decision", kind});
    f.Counter("shardcoord_module_decisions_total", "Module decisions given, by module and kind", std::move(l),
              static_cast<double>(n));
  }
  f.Counter("shardcoord_divergent_decisions_total", "Module decisions made because the group's plans diverged",
            with_module, static_cast<double>(c.divergent()));
}

void Groups(Families& f, const v1::StatusResponse& status, const v1::ListGroupsResponse& groups) {
  static const std::vector<std::string> kStates = StateNames<v1::GroupState>(v1::GroupState_descriptor());
  std::map<std::string, std::map<std::string, int>> by_state;  // job -> state -> groups
  for (const auto& j : status.jobs()) {
    for (const auto& s : kStates) by_state[j.job_id()][s] = 0;
  }
  for (const auto& g : groups.groups()) {
    by_state[g.job_id()][StateName(g.state())]++;
    const Labels base = {{"job_id", g.job_id()}, {"group", std::to_string(g.group())}};
    f.Gauge("shardcoord_group_epoch", "The group's epoch (increases when it re-forms)", base,
            static_cast<double>(g.epoch()));
    f.Gauge("shardcoord_group_pending_microbatches", "Microbatches some members planned and others not yet", base,
            g.pending_microbatches());
    for (const auto& [module, c] : std::map<std::string, v1::DecisionCounts>(g.module_counts().begin(),
                                                                              g.module_counts().end())) {
      ModuleCounts(f, base, module, c);
    }
  }
  for (const auto& [job, states] : by_state) {
    for (const auto& [state, n] : states) {
      f.Gauge("shardcoord_groups", "Shard groups by state", {{"job_id", job}, {"state", state}}, n);
    }
  }
}

// Per job: the rank counters summed, the stalest heartbeat and frozen memory by module; per
// rank (heartbeat age) only for jobs of at most `rank_series_max` ranks, so that a 16k-rank
// job adds one series, not 16k.
void Ranks(Families& f, const Snapshot& s) {
  std::map<std::string, int> world;  // job -> world size
  for (const auto& j : s.status.jobs()) world[j.job_id()] = j.world_size();
  struct PerJob {
    double oldest = 0;
    int64_t rejected = 0, registrations = 0, stalls = 0, stall_us = 0;
    std::map<std::string, std::pair<int64_t, int64_t>> memory;  // module -> (max peak, gathered sum)
  };
  std::map<std::string, PerJob> jobs;
  for (const auto& j : s.status.jobs()) jobs[j.job_id()];
  for (const auto& r : s.ranks.ranks()) {
    PerJob& pj = jobs[r.job_id()];
    pj.rejected += r.plans_rejected();
    pj.registrations += r.registrations();
    pj.stalls += r.decision_stalls();
    pj.stall_us += r.decision_stall_us();
    for (const auto& m : r.memory()) {
      auto& [peak, gathered] = pj.memory[m.module()];
      peak = std::max(peak, m.peak_bytes());
      gathered += m.gathered_bytes();
    }
    if (r.state() != v1::RANK_STATE_LIVE) continue;
    const double age = r.last_heartbeat_age_ms() / 1000.0;
    pj.oldest = std::max(pj.oldest, age);
    if (world[r.job_id()] <= s.rank_series_max) {
      f.Gauge("shardcoord_rank_heartbeat_age_seconds", "Time since a live rank's last heartbeat (jobs of at most "
              "metrics_rank_series_max ranks)", {{"job_id", r.job_id()}, {"rank", std::to_string(r.rank())}}, age);
    }
  }
  for (const auto& [job, pj] : jobs) {
    const Labels l = {{"job_id", job}};
    f.Gauge("shardcoord_heartbeat_age_max_seconds", "Time since the least recent heartbeat of a live rank (0: none live)",
            l, pj.oldest);
    f.Counter("shardcoord_plans_rejected_total", "Plans the daemon rejected (malformed, out of order, outside the "
              "window), summed over the job's ranks", l, static_cast<double>(pj.rejected));
    f.Counter("shardcoord_rank_registrations_total", "Registrations of the job's ranks (first, rejoins after a "
              "death, resumes after a reconnect)", l, static_cast<double>(pj.registrations));
    f.Counter("shardcoord_decision_stalls_total", "Times a trainer asked for a decision not yet in its lookahead "
              "window and waited, summed over the job's ranks (their heartbeats report it)", l,
              static_cast<double>(pj.stalls));
    f.Counter("shardcoord_decision_stall_seconds_total", "Time trainers waited for decisions, summed over the job's "
              "ranks", l, pj.stall_us / 1e6);
    for (const auto& [module, mem] : pj.memory) {
      const Labels lm = {{"job_id", job}, {"module", module}};
      f.Gauge("shardcoord_frozen_peak_bytes", "Highest frozen-parameter memory of the module on any rank, as the "
              "trainers report it", lm, static_cast<double>(mem.first));
      f.Counter("shardcoord_gathered_bytes_total", "Bytes of the module materialized by all-gathers, summed over "
                "the job's ranks, as the trainers report them", lm, static_cast<double>(mem.second));
    }
  }
}

void Comms(Families& f, const Snapshot& s) {
  static const std::vector<std::string> kStates = StateNames<v1::CommState>(v1::CommState_descriptor());
  std::map<std::string, std::map<std::string, int>> by_state;  // job -> state -> communicators
  for (const auto& j : s.status.jobs()) {
    for (const auto& st : kStates) by_state[j.job_id()][st] = 0;
  }
  for (const auto& c : s.comms.comms()) {
    by_state[c.job_id()][StateName(c.state())]++;
    const Labels l = {{"job_id", c.job_id()}, {"comm", c.name()}};
    f.Gauge("shardcoord_communicator_epoch", "A named communicator's epoch", l, static_cast<double>(c.epoch()));
    f.Counter("shardcoord_communicator_aborts_total", "Epochs of the communicator that ended in an abort", l,
              static_cast<double>(c.epochs_aborted()));
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
  if (paren == std::string::npos) return;
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
  Groups(f, snapshot.status, snapshot.groups);
  Ranks(f, snapshot);
  Comms(f, snapshot);
  if (snapshot.process) Process(f);
  if (snapshot.daemon != nullptr) snapshot.daemon->AppendTo(&f.all());
  return prometheus::TextSerializer().Serialize(f.all());
}

}  // namespace shardcoord::coordinator
