// _shardcoord: the Python binding of the worker library (pybind11). The Python package
// `shardcoord` (python/shardcoord/) wraps it in Python idiom; import that, not this.
//
// Blocking calls (connect, get_decision, await_group_ready, close) release the GIL while
// they wait, so a data-loader thread can keep reporting plans. Errors become
// shardcoord.Error subclasses chosen by the status code (see python/shardcoord/errors.py),
// carrying the coordinator's message.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "shardcoord/classify.h"
#include "shardcoord/types.h"
#include "shardcoord/version.h"
#include "shardcoord/worker.h"

namespace py = pybind11;

namespace shardcoord {
namespace {

// Raises the Python exception for `status` (set up by the package: errors.raise_for_code).
[[noreturn]] void Raise(const absl::Status& status) {
  py::gil_scoped_acquire gil;
  py::object raise = py::module_::import("shardcoord.errors").attr("raise_for_code");
  raise(static_cast<int>(status.code()), std::string(status.message()));
  throw py::error_already_set();  // raise_for_code always raises; never reached otherwise.
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

absl::Duration Seconds(double s, const char* what) {
  if (!std::isfinite(s) || s < 0) {
    Raise(absl::InvalidArgumentError(std::string(what) + " must be a finite number of seconds >= 0"));
  }
  return absl::Seconds(s);
}

template <typename T, typename P>
T ParseOr(const std::string& name, P parse, const char* what, const char* choices) {
  auto v = parse(name);
  if (!v) Raise(absl::InvalidArgumentError(std::string("unknown ") + what + " '" + name + "'; use " + choices));
  return *v;
}

py::dict DecisionToDict(const MicrobatchDecision& d) {
  py::dict modules;
  for (const auto& m : d.modules) {
    modules[py::str(m.module)] = py::make_tuple(DecisionName(m.decision), DecisionReasonName(m.reason));
  }
  py::dict out;
  out["group"] = d.group;
  out["step"] = d.key.step;
  out["microbatch"] = d.key.microbatch;
  out["epoch"] = d.epoch;
  out["seq"] = d.seq;
  out["digest"] = d.digest;
  out["modules"] = modules;
  return out;
}

// The native worker. Thread-safe, as the C++ Worker.
class PyWorker {
 public:
  explicit PyWorker(std::unique_ptr<Worker> w) : w_(std::move(w)) {}

  void ReportPlan(int64_t step, int64_t microbatch, const std::map<std::string, int64_t>& calls) {
    if (microbatch < 0 || microbatch > INT32_MAX) {
      Raise(absl::InvalidArgumentError("microbatch " + std::to_string(microbatch) + " must be in 0..2147483647"));
    }
    MicrobatchPlan plan{{step, static_cast<int32_t>(microbatch)}, {}};
    for (const auto& [name, n] : calls) {
      if (n < 0 || n > INT32_MAX) {
        Raise(absl::InvalidArgumentError("module '" + name + "' has " + std::to_string(n) +
                                         " calls; calls must be in 0..2147483647"));
      }
      plan.calls[name] = static_cast<int32_t>(n);
    }
    absl::Status s;
    {
      py::gil_scoped_release nogil;  // Never blocks on the network, but takes the worker's lock.
      s = worker().ReportPlan(plan);
    }
    Check(s);
  }

  py::dict GetDecision(int64_t step, int64_t microbatch, double timeout_s) {
    if (microbatch < 0 || microbatch > INT32_MAX) {
      Raise(absl::InvalidArgumentError("microbatch " + std::to_string(microbatch) + " must be in 0..2147483647"));
    }
    const absl::Duration timeout = Seconds(timeout_s, "timeout");
    absl::StatusOr<MicrobatchDecision> d;
    {
      py::gil_scoped_release nogil;
      d = worker().GetDecision({step, static_cast<int32_t>(microbatch)}, timeout);
    }
    Check(d.status());
    return DecisionToDict(*d);
  }

  void ReportMemory(const std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>>& usage) {
    std::vector<ModuleMemoryUsage> u;
    for (const auto& [module, resident, peak, gathered] : usage) u.push_back({module, resident, peak, gathered});
    worker().ReportMemory(u);
  }

  void Health() const { Check(worker().Health()); }
  void JobHealth() const { Check(worker().JobHealth()); }
  int UndecidedPlans() const { return worker().UndecidedPlans(); }

  void AwaitGroupReady(double timeout_s) {
    const absl::Duration timeout = Seconds(timeout_s, "timeout");
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = worker().AwaitGroupReady(timeout);
    }
    Check(s);
  }

  py::dict Group() const {
    const GroupInfo g = worker().group();
    py::dict out;
    out["group"] = g.group;
    out["ranks"] = g.ranks;
    out["epoch"] = g.epoch;
    out["policy"] = PolicyName(g.policy);
    out["fallback"] = FallbackName(g.fallback);
    out["lookahead"] = g.lookahead;
    out["warnings"] = g.warnings;
    return out;
  }

  void Close(double timeout_s, const std::string& reason) {
    const absl::Duration timeout = Seconds(timeout_s, "timeout");
    if (!w_) return;
    py::gil_scoped_release nogil;
    if (reason.empty()) {
      w_->Close(timeout);
    } else {
      w_->Close(reason, timeout);
    }
  }

 private:
  Worker& worker() const {
    if (!w_) Raise(absl::FailedPreconditionError("worker is closed"));
    return *w_;
  }
  std::unique_ptr<Worker> w_;
};

PyWorker Connect(const std::string& address, const std::string& job_id, int rank, int world_size, int group_size,
                 const std::vector<std::tuple<std::string, int64_t, std::vector<std::pair<std::string, int64_t>>,
                                              bool>>& modules,
                 const std::string& policy, const std::string& fallback, bool wrap_outer_model, int lookahead,
                 int64_t memory_budget_bytes, double connect_timeout_s, double reconnect_window_s,
                 const std::string& token, const std::tuple<std::string, std::string, std::string, std::string>& tls) {
  WorkerOptions o;
  o.coordinator_address = address;
  o.job_id = job_id;
  o.rank = rank;
  o.world_size = world_size;
  o.group_size = group_size;
  for (const auto& [name, bytes, units, outside] : modules) {
    ModuleSpec spec{name, bytes, {}, outside};
    for (const auto& [unit, unit_bytes] : units) spec.units.push_back({unit, unit_bytes});
    o.modules.push_back(std::move(spec));
  }
  o.policy = policy.empty() ? Policy::kUnspecified
                            : ParseOr<Policy>(policy, ParsePolicy, "policy", "auto, per_layer, root or replicate");
  o.fallback = fallback.empty() ? Fallback::kUnspecified
                                : ParseOr<Fallback>(fallback, ParseFallback, "fallback", "root or replicate");
  o.wrap_outer_model = wrap_outer_model;
  if (lookahead < 0) Raise(absl::InvalidArgumentError("lookahead must be >= 0 (0: the default, 4)"));
  o.lookahead = lookahead;
  if (memory_budget_bytes < 0) Raise(absl::InvalidArgumentError("memory_budget_bytes must be >= 0"));
  o.memory_budget_bytes = memory_budget_bytes;
  o.connect_timeout = Seconds(connect_timeout_s, "connect_timeout");
  o.reconnect_window = Seconds(reconnect_window_s, "reconnect_window");  // 0: no reconnect.
  o.token = token;  // Empty: $SHARDCOORD_TOKEN or $SHARDCOORD_TOKEN_FILE.
  // Empty fields: $SHARDCOORD_TLS_CA, _CERT, _KEY, _SERVER_NAME.
  std::tie(o.tls.ca_file, o.tls.cert_file, o.tls.key_file, o.tls.server_name) = tls;
  absl::StatusOr<std::unique_ptr<Worker>> w;
  {
    py::gil_scoped_release nogil;
    w = Worker::Connect(std::move(o));
  }
  Check(w.status());
  return PyWorker(std::move(*w));
}

std::vector<std::tuple<std::string, std::string, bool>> Classify(
    const std::vector<std::tuple<std::string, int64_t, int64_t>>& nodes, const std::vector<std::string>& extra_towers,
    const std::vector<std::string>& extra_projectors) {
  std::vector<ModuleNode> in;
  for (const auto& [path, params, trainable] : nodes) in.push_back({path, params, trainable});
  ClassifyOptions opts{extra_towers, extra_projectors};
  std::vector<std::tuple<std::string, std::string, bool>> out;
  for (const auto& c : ClassifyModules(in, opts)) {
    out.emplace_back(c.path, c.kind == ModuleKind::kTower ? "tower" : "projector", c.fully_frozen);
  }
  return out;
}

}  // namespace
}  // namespace shardcoord

PYBIND11_MODULE(_shardcoord, m) {
  using namespace shardcoord;
  m.doc() = "Native part of the shardcoord package; use `import shardcoord`.";
  m.attr("__version__") = shardcoord::kVersion;
  py::class_<PyWorker>(m, "NativeWorker")
      .def("report_plan", &PyWorker::ReportPlan, py::arg("step"), py::arg("microbatch"), py::arg("calls"))
      .def("get_decision", &PyWorker::GetDecision, py::arg("step"), py::arg("microbatch"), py::arg("timeout"))
      .def("report_memory", &PyWorker::ReportMemory, py::arg("usage"))
      .def("health", &PyWorker::Health)
      .def("job_health", &PyWorker::JobHealth)
      .def("undecided_plans", &PyWorker::UndecidedPlans)
      .def("await_group_ready", &PyWorker::AwaitGroupReady, py::arg("timeout"))
      .def("group", &PyWorker::Group)
      .def("close", &PyWorker::Close, py::arg("timeout"), py::arg("reason") = "");
  m.def("connect", &Connect, py::arg("address"), py::arg("job_id"), py::arg("rank"), py::arg("world_size"),
        py::arg("group_size"), py::arg("modules"), py::arg("policy"), py::arg("fallback"),
        py::arg("wrap_outer_model"), py::arg("lookahead"), py::arg("memory_budget_bytes"),
        py::arg("connect_timeout"), py::arg("reconnect_window"), py::arg("token"),
        py::arg("tls"));
  m.def("classify", &Classify, py::arg("nodes"), py::arg("extra_towers"), py::arg("extra_projectors"),
        "Classifies (path, num_params, num_trainable) nodes with the contract's rules: "
        "[(path, 'tower'|'projector', fully_frozen)].");
  m.def("builtin_tower_names", &BuiltinTowerNames);
  m.def("builtin_projector_names", &BuiltinProjectorNames);
}
