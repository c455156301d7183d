// The manifest's types, bound: shardcoord.LayerUnit and shardcoord.ModuleSpec are the C++
// LayerUnit and ModuleSpec (contract/include/shardcoord/types.h). Immutable from Python, as
// the frozen dataclasses they replace: compared, hashed and pickled by value.
#include <cstdint>
#include <string>
#include <utility>

#include "common.h"

namespace shardcoord::python {
namespace {

py::tuple Units(const ModuleSpec& s) {
  py::tuple out(s.units.size());
  for (size_t i = 0; i < s.units.size(); ++i) out[i] = py::cast(s.units[i]);
  return out;
}

py::tuple UnitFields(const LayerUnit& u) { return py::make_tuple(u.name, u.param_bytes); }

py::tuple SpecFields(const ModuleSpec& s) {
  return py::make_tuple(s.name, s.param_bytes, Units(s), s.outside_inner_root, s.trainable);
}

}  // namespace

void BindManifest(py::module_& m) {
  py::class_<LayerUnit> unit(m, "LayerUnit",
                             "One layer unit of a controlled module: ``name`` relative to the module (\"\": the "
                             "rest unit, or the whole module), its parameter bytes.");
  unit.def(py::init([](std::string name, int64_t param_bytes) { return LayerUnit{std::move(name), param_bytes}; }),
           py::arg("name"), py::arg("param_bytes"))
      .def_readonly("name", &LayerUnit::name)
      .def_readonly("param_bytes", &LayerUnit::param_bytes);
  DefValue<LayerUnit>(unit, {"name", "param_bytes"}, UnitFields, /*hashable=*/true);

  py::class_<ModuleSpec> spec(m, "ModuleSpec",
                              "A controlled multimodal module, as registered with the coordinator; ``units`` is a "
                              "tuple of LayerUnit; ``trainable``: some of its parameters train (opted in: only skip, "
                              "per_layer and root are decided for it).");
  spec.def(py::init([](std::string name, int64_t param_bytes, const py::iterable& units, bool outside_inner_root,
                       bool trainable) {
             return ModuleSpec{std::move(name), param_bytes, ListOf<LayerUnit>(units, "units", "LayerUnit"),
                               outside_inner_root, trainable};
           }),
           py::arg("name"), py::arg("param_bytes"), py::arg("units") = py::tuple(),
           py::arg("outside_inner_root") = false, py::arg("trainable") = false)
      .def_readonly("name", &ModuleSpec::name)
      .def_readonly("param_bytes", &ModuleSpec::param_bytes)
      .def_property_readonly("units", Units)
      .def_readonly("outside_inner_root", &ModuleSpec::outside_inner_root)
      .def_readonly("trainable", &ModuleSpec::trainable);
  DefValue<ModuleSpec>(spec, {"name", "param_bytes", "units", "outside_inner_root", "trainable"}, SpecFields,
                       /*hashable=*/true);
}

}  // namespace shardcoord::python
