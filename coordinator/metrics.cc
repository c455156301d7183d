#include "coordinator/metrics.h"

#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <utility>
#include <vector>

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
  const std::vector<MetricFamily>& all() const { return families_; }

 private:
  std::vector<MetricFamily> families_;
  std::map<std::string, size_t> index_;
};

void Daemon(Families& f, const v1::StatusResponse& s) {
  f.Gauge("shardcoord_build_info", "shardcoord version, always 1", {{"version", s.version()}}, 1);
  f.Gauge("shardcoord_start_time_seconds", "When this daemon started, Unix time", {}, s.started_unix_ms() / 1000.0);
  f.Gauge("shardcoord_incarnation", "This daemon process's incarnation (increases at each restart)", {},
          static_cast<double>(s.incarnation()));
  f.Gauge("shardcoord_jobs", "Jobs held", {}, s.jobs_size());
  f.Gauge("shardcoord_recovering_groups", "Groups waiting for members to resume after a restart", {},
          s.recovering_groups());
}

void Jobs(Families& f, const v1::StatusResponse& s) {
  for (const auto& j : s.jobs()) {
    const std::string& job = j.job_id();
    f.Gauge("shardcoord_job_world_size", "Ranks in the job", {{"job", job}}, j.world_size());
    for (const auto& [state, n] : std::vector<std::pair<const char*, int>>{
             {"live", j.ranks_live()}, {"dead", j.ranks_dead()}, {"left", j.ranks_left()},
             {"unregistered", j.ranks_unregistered()}}) {
      f.Gauge("shardcoord_ranks", "Ranks by state", {{"job", job}, {"state", state}}, n);
    }
    f.Counter("shardcoord_plans_received_total", "Microbatch plans received from the job's ranks", {{"job", job}},
              static_cast<double>(j.plans_received()));
    f.Counter("shardcoord_microbatches_decided_total", "Microbatches decided", {{"job", job}},
              static_cast<double>(j.microbatches_decided()));
  }
}

void Groups(Families& f, const v1::ListGroupsResponse& groups) {
  std::map<std::pair<std::string, std::string>, int> by_state;
  for (const auto& g : groups.groups()) {
    by_state[{g.job_id(), StateName(g.state())}]++;
    const Labels base = {{"job", g.job_id()}, {"group", std::to_string(g.group())}};
    f.Gauge("shardcoord_group_epoch", "The group's epoch (increases when it re-forms)", base,
            static_cast<double>(g.epoch()));
    f.Gauge("shardcoord_group_pending_microbatches", "Microbatches some members planned and others not yet", base,
            g.pending_microbatches());
    const auto& c = g.counts();
    for (const auto& [kind, n] : std::vector<std::pair<const char*, int64_t>>{
             {"per_layer", c.per_layer()}, {"skip", c.skip()}, {"root", c.root()}, {"replicate", c.replicate()}}) {
      Labels l = base;
      l.push_back({"decision", kind});
      f.Counter("shardcoord_module_decisions_total", "Module decisions given, by kind", std::move(l),
                static_cast<double>(n));
    }
    f.Counter("shardcoord_divergent_decisions_total", "Module decisions made because the group's plans diverged", base,
              static_cast<double>(c.divergent()));
  }
  for (const auto& [key, n] : by_state) {
    f.Gauge("shardcoord_groups", "Shard groups by state", {{"job", key.first}, {"state", key.second}}, n);
  }
}

void RanksAndComms(Families& f, const Snapshot& s) {
  std::map<std::string, double> oldest;  // job -> largest heartbeat age of a live rank (s)
  for (const auto& r : s.ranks.ranks()) {
    if (r.state() != v1::RANK_STATE_LIVE) continue;
    double& o = oldest[r.job_id()];
    o = std::max(o, r.last_heartbeat_age_ms() / 1000.0);
  }
  for (const auto& [job, age] : oldest) {
    f.Gauge("shardcoord_heartbeat_age_max_seconds", "Time since the least recent heartbeat of a live rank",
            {{"job", job}}, age);
  }
  std::map<std::pair<std::string, std::string>, int> by_state;
  for (const auto& c : s.comms.comms()) {
    by_state[{c.job_id(), StateName(c.state())}]++;
    f.Gauge("shardcoord_communicator_epoch", "A named communicator's epoch", {{"job", c.job_id()}, {"comm", c.name()}},
            static_cast<double>(c.epoch()));
  }
  for (const auto& [key, n] : by_state) {
    f.Gauge("shardcoord_communicators", "Named communicators by state", {{"job", key.first}, {"state", key.second}}, n);
  }
}

}  // namespace

std::string MetricsText(const Snapshot& snapshot) {
  Families f;
  Daemon(f, snapshot.status);
  Jobs(f, snapshot.status);
  Groups(f, snapshot.groups);
  RanksAndComms(f, snapshot);
  return prometheus::TextSerializer().Serialize(f.all());
}

}  // namespace shardcoord::coordinator
