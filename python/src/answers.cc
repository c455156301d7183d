// What the coordinator answers, bound: shardcoord.Decision and shardcoord.ModuleDecision (the
// Python face of a MicrobatchDecision, common.h: converted once, when the decision arrives) and
// shardcoord.GroupInfo (the C++ GroupInfo, policy and fallback by name). Immutable from Python,
// compared and pickled by value, as the frozen dataclasses they replace.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "shardcoord/worker.h"

namespace shardcoord::python {
namespace {

py::tuple ModuleFields(const PyModuleDecision& d) { return py::make_tuple(d.decision, d.reason, d.calls); }

py::tuple DecisionFields(const PyDecision& d) {
  return py::make_tuple(d.group, d.step, d.microbatch, d.epoch, d.seq, d.digest, d.modules);
}

py::tuple GroupFields(const GroupInfo& g) {
  return py::make_tuple(g.group, py::cast(g.ranks), g.epoch, PolicyName(g.policy), FallbackName(g.fallback),
                        g.lookahead, py::cast(g.warnings));
}

// A dict of module name -> ModuleDecision, copied from any mapping of them.
py::dict Modules(const py::object& modules) {
  py::dict out;
  for (const auto& [name, d] : py::dict(modules)) {
    if (!py::isinstance<py::str>(name) || !py::isinstance<PyModuleDecision>(d)) {
      Raise(absl::InvalidArgumentError("Decision modules must map module names to shardcoord.ModuleDecision, got " +
                                       TypeName(name) + " -> " + TypeName(d)));
    }
    out[name] = d;
  }
  return out;
}

void BindDecision(py::module_& m) {
  py::class_<PyModuleDecision> module(m, "ModuleDecision",
                                      "One module's part of a decision: decision, reason and (padded) calls.");
  module.def(py::init([](std::string decision, std::string reason, int32_t calls) {
               return PyModuleDecision{std::move(decision), std::move(reason), calls};
             }),
             py::arg("decision"), py::arg("reason"), py::arg("calls") = 0)
      .def_readonly("decision", &PyModuleDecision::decision,
                    "\"per_layer\", \"skip\", \"root\", \"replicate\" or \"padded\"")
      .def_readonly("reason", &PyModuleDecision::reason,
                    "\"uniform\", \"all_skip\", \"divergent\", \"static_policy\", \"sticky_replicate\", \"promoted\", "
                    "\"cost\"")
      .def_readonly("calls", &PyModuleDecision::calls,
                    "\"padded\": the passes every rank of the group makes over the module (the busiest rank's "
                    "calls; a rank that calls it less makes gather-only passes); 0 for the other decisions");
  DefValue<PyModuleDecision>(module, {"decision", "reason", "calls"}, ModuleFields, /*hashable=*/true);

  py::class_<PyDecision> decision(m, "Decision",
                                  "The group's decision for one microbatch: identical on every rank of the group. "
                                  "decision[module] is that module's ModuleDecision.");
  decision
      .def(py::init([](int32_t group, int64_t step, int32_t microbatch, int64_t epoch, uint64_t seq, uint64_t digest,
                       const py::object& modules) {
             return PyDecision{group, step, microbatch, epoch, seq, digest, Modules(modules)};
           }),
           py::arg("group"), py::arg("step"), py::arg("microbatch"), py::arg("epoch"), py::arg("seq"),
           py::arg("digest"), py::arg("modules") = py::dict())
      .def_readonly("group", &PyDecision::group)
      .def_readonly("step", &PyDecision::step)
      .def_readonly("microbatch", &PyDecision::microbatch)
      .def_readonly("epoch", &PyDecision::epoch)
      .def_readonly("seq", &PyDecision::seq)
      .def_readonly("digest", &PyDecision::digest)
      .def_readonly("modules", &PyDecision::modules, "module name -> ModuleDecision, in manifest order")
      .def("__getitem__", [](const PyDecision& d, const py::str& module) { return py::object(d.modules[module]); });
  DefValue<PyDecision>(decision, {"group", "step", "microbatch", "epoch", "seq", "digest", "modules"}, DecisionFields,
                       /*hashable=*/false);
}

void BindGroup(py::module_& m) {
  py::class_<GroupInfo> group(m, "GroupInfo", "What registration established: this rank's shard group.");
  group
      .def(py::init([](int number, std::vector<int> ranks, int64_t epoch, const std::string& policy,
                       const std::string& fallback, int lookahead, std::vector<std::string> warnings) {
             GroupInfo g;
             g.group = number;
             g.ranks = std::move(ranks);
             g.epoch = epoch;
             g.policy = PolicyFromName(policy);
             g.fallback = FallbackFromName(fallback);
             g.lookahead = lookahead;
             g.warnings = std::move(warnings);
             return g;
           }),
           py::arg("group"), py::arg("ranks"), py::arg("epoch"), py::arg("policy"), py::arg("fallback"),
           py::arg("lookahead"), py::arg("warnings"))
      .def_readonly("group", &GroupInfo::group)
      .def_readonly("ranks", &GroupInfo::ranks, "members, ascending")
      .def_readonly("epoch", &GroupInfo::epoch)
      .def_property_readonly("policy", [](const GroupInfo& g) { return PolicyName(g.policy); }, "effective")
      .def_property_readonly("fallback", [](const GroupInfo& g) { return FallbackName(g.fallback); })
      .def_readonly("lookahead", &GroupInfo::lookahead)
      .def_readonly("warnings", &GroupInfo::warnings);
  DefValue<GroupInfo>(group, {"group", "ranks", "epoch", "policy", "fallback", "lookahead", "warnings"}, GroupFields,
                      /*hashable=*/false);
}

}  // namespace

PyDecision ToPython(const MicrobatchDecision& d) {
  py::dict modules;
  for (const auto& md : d.modules) {
    modules[py::str(md.module)] =
        PyModuleDecision{DecisionName(md.decision), DecisionReasonName(md.reason), md.calls};
  }
  return {d.group, d.key.step, d.key.microbatch, d.epoch, d.seq, d.digest, std::move(modules)};
}

void BindAnswers(py::module_& m) {
  BindDecision(m);
  BindGroup(m);
}

}  // namespace shardcoord::python
