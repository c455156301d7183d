// _shardcoord: the Python binding of the worker library (pybind11). The Python package
// `shardcoord` (python/shardcoord/) wraps it in Python idiom; import that, not this.
//
// The types Python code builds and receives are bound C++ types: the manifest (manifest.cc),
// the options a worker connects with (options.cc), decisions and the group (answers.cc); so
// `connect` takes one WorkerOptions and a decision arrives converted once. This file: the
// module, the worker, errors.
//
// Blocking calls (connect, get_decision, await_group_ready, close) release the GIL while
// they wait, so a data-loader thread can keep reporting plans. Errors become
// shardcoord.Error subclasses chosen by the status code (see python/shardcoord/errors.py),
// carrying the coordinator's message.
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "shardcoord/classify.h"
#include "shardcoord/version.h"
#include "shardcoord/worker.h"

namespace shardcoord::python {

void Raise(const absl::Status& status) {
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

namespace {

template <typename T, typename P>
T FromName(const std::string& name, P parse, const char* unspecified, const char* what, const char* choices) {
  if (name.empty() || name == unspecified) return T::kUnspecified;
  auto v = parse(name);
  if (!v) Raise(absl::InvalidArgumentError(std::string("unknown ") + what + " '" + name + "'; use " + choices));
  return *v;
}

}  // namespace

Policy PolicyFromName(const std::string& name) {
  return FromName<Policy>(name, ParsePolicy, PolicyName(Policy::kUnspecified), "policy",
                          "auto, per_layer, root or replicate");
}

Fallback FallbackFromName(const std::string& name) {
  return FromName<Fallback>(name, ParseFallback, FallbackName(Fallback::kUnspecified), "fallback",
                            "root, replicate or padded");
}

std::string TypeName(const py::handle& obj) {
  return py::str(py::type::of(obj).attr("__name__")).cast<std::string>();
}

std::string ReprOf(const py::handle& self, const std::vector<const char*>& names, const py::tuple& values) {
  std::string out = TypeName(self) + "(";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::string(names[i]) + "=" + py::repr(values[i]).cast<std::string>();
  }
  return out + ")";
}

namespace {

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

  PyDecision GetDecision(int64_t step, int64_t microbatch, double timeout_s) {
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
    return ToPython(*d);
  }

  void ReportMemory(const std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>>& usage) {
    std::vector<ModuleMemoryUsage> u;
    for (const auto& [module, resident, peak, gathered] : usage) u.push_back({module, resident, peak, gathered});
    worker().ReportMemory(u);
  }

  using UnitCostTuple = std::tuple<std::string, int64_t, double>;
  void ReportCosts(const std::vector<std::tuple<std::string, double, std::vector<UnitCostTuple>>>& costs,
                   int64_t frozen_budget_bytes) {
    std::vector<ModuleCost> c;
    for (const auto& [module, forward, units] : costs) {
      ModuleCost mc{module, forward, {}};
      for (const auto& [unit, bytes, seconds] : units) mc.units.push_back({unit, bytes, seconds});
      c.push_back(std::move(mc));
    }
    worker().ReportCosts(c, frozen_budget_bytes);
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

  GroupInfo Group() const { return worker().group(); }

  void Close(double timeout_s, const std::string& reason, bool failed) {
    const absl::Duration timeout = Seconds(timeout_s, "timeout");
    if (!w_) return;
    py::gil_scoped_release nogil;
    if (failed) {
      w_->Fail(reason, timeout);
    } else if (reason.empty()) {
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

PyWorker Connect(WorkerOptions options) {  // Its fields were checked as they were set.
  absl::StatusOr<std::unique_ptr<Worker>> w;
  {
    py::gil_scoped_release nogil;
    w = Worker::Connect(std::move(options));
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

void BindWorker(py::module_& m) {
  py::class_<PyWorker>(m, "NativeWorker")
      .def("report_plan", &PyWorker::ReportPlan, py::arg("step"), py::arg("microbatch"), py::arg("calls"))
      .def("get_decision", &PyWorker::GetDecision, py::arg("step"), py::arg("microbatch"), py::arg("timeout"))
      .def("report_memory", &PyWorker::ReportMemory, py::arg("usage"))
      .def("report_costs", &PyWorker::ReportCosts, py::arg("costs"), py::arg("frozen_budget_bytes") = 0)
      .def("health", &PyWorker::Health)
      .def("job_health", &PyWorker::JobHealth)
      .def("undecided_plans", &PyWorker::UndecidedPlans)
      .def("await_group_ready", &PyWorker::AwaitGroupReady, py::arg("timeout"))
      .def("group", &PyWorker::Group)
      .def("close", &PyWorker::Close, py::arg("timeout"), py::arg("reason") = "", py::arg("failed") = false);
  m.def("connect", &Connect, py::arg("options"),
        "Connects and registers within options.connect_timeout (the GIL released meanwhile).");
}

}  // namespace
}  // namespace shardcoord::python

PYBIND11_MODULE(_shardcoord, m) {
  using namespace shardcoord::python;
  m.doc() = "Native part of the shardcoord package; use `import shardcoord`.";
  m.attr("__version__") = shardcoord::kVersion;
  // The placement kinds (decisions.def), in its order: shardcoord.torch._placement checks its own against them.
  m.attr("DECISIONS") = py::tuple(py::cast(shardcoord::DecisionNames()));
  BindManifest(m);
  BindOptions(m);
  BindAnswers(m);
  BindWorker(m);
  m.def("classify", &Classify, py::arg("nodes"), py::arg("extra_towers"), py::arg("extra_projectors"),
        "Classifies (path, num_params, num_trainable) nodes with the contract's rules: "
        "[(path, 'tower'|'projector', fully_frozen)].");
  m.def("builtin_tower_names", &shardcoord::BuiltinTowerNames);
  m.def("builtin_projector_names", &shardcoord::BuiltinProjectorNames);
}
