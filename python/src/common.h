// What the binding's translation units (python/src/*.cc) share: errors raised as the package's
// exceptions, argument checks, the Python face of a decision, and the dataclass-like methods of
// the bound value types (the Python package used to define them as frozen dataclasses, and code
// compares, hashes, prints and pickles them).
#ifndef SHARDCOORD_PYTHON_COMMON_H_
#define SHARDCOORD_PYTHON_COMMON_H_

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // In every unit that converts containers, so that all convert them alike.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "shardcoord/types.h"

namespace shardcoord::python {

namespace py = pybind11;

// Raises the Python exception for `status` (shardcoord.errors.raise_for_code: a shardcoord.Error
// subclass chosen by the code, carrying the message).
[[noreturn]] void Raise(const absl::Status& status);
void Check(const absl::Status& status);
// InvalidArgument naming `what` unless `s` is a finite number of seconds >= 0.
absl::Duration Seconds(double s, const char* what);
// By name, as in flags and logs; "" (or "unspecified"): unspecified. InvalidArgument otherwise.
Policy PolicyFromName(const std::string& name);
Fallback FallbackFromName(const std::string& name);

// The items of `items`, each of which must be a bound T (InvalidArgument naming `what` and the
// Python type `type_name` otherwise): how a list of bound objects is taken in.
template <typename T>
std::vector<T> ListOf(const py::iterable& items, const char* what, const char* type_name);

// A decision as Python sees it: modules by name (a dict built once, when the decision arrives),
// decisions and reasons by name. Hand-made ones (a trainer deciding locally, a benchmark) are
// built the same way.
struct PyModuleDecision {
  std::string decision;  // "per_layer", "skip", "root", "replicate" or "padded".
  std::string reason;    // "uniform", "all_skip", "divergent", "static_policy", "sticky_replicate", "promoted", "cost".
  int32_t calls = 0;     // "padded": the passes every rank of the group makes; 0 otherwise.
};

struct PyDecision {
  int32_t group = 0;
  int64_t step = 0;
  int32_t microbatch = 0;
  int64_t epoch = 0;
  uint64_t seq = 0;
  uint64_t digest = 0;
  py::dict modules;  // Module name -> PyModuleDecision, in manifest order.
};

PyDecision ToPython(const MicrobatchDecision& d);

void BindManifest(py::module_& m);  // LayerUnit, ModuleSpec.
void BindOptions(py::module_& m);   // TlsOptions, WorkerOptions.
void BindAnswers(py::module_& m);   // ModuleDecision, Decision, GroupInfo.

// --- Dataclass-like methods. `fields(value)` is the value's fields in `names` order, which is
// also the order its constructor takes them in.

template <typename T>
using Fields = py::tuple (*)(const T&);

// "Type(name=repr(value), ...)", as a dataclass prints.
std::string ReprOf(const py::handle& self, const std::vector<const char*>& names, const py::tuple& values);
std::string TypeName(const py::handle& obj);

template <typename T>
void DefRepr(py::class_<T>& cls, std::vector<const char*> names, Fields<T> fields) {
  cls.def("__repr__", [names, fields](const py::object& self) {
    return ReprOf(self, names, fields(self.cast<const T&>()));
  });
}

// __repr__; __eq__ over the fields; __hash__ for the immutable ones (without it Python leaves the
// type unhashable, as a frozen dataclass holding a list or dict is in effect); pickling (and so
// copy.copy / deepcopy) through the constructor.
template <typename T>
void DefValue(py::class_<T>& cls, std::vector<const char*> names, Fields<T> fields, bool hashable) {
  DefRepr(cls, names, fields);
  cls.def("__eq__", [fields](const T& a, const T& b) { return fields(a).equal(fields(b)); }, py::is_operator());
  if (hashable) cls.def("__hash__", [fields](const T& v) { return py::hash(fields(v)); });
  cls.def("__reduce__", [fields](const py::object& self) {
    return py::make_tuple(py::type::of(self), fields(self.cast<const T&>()));
  });
}

// Keyword construction through the attributes' own setters, so that each value is checked in one
// place: T(job_id="run-42", rank=0). Positional arguments are refused: the fields are many, and
// named ones say which is which.
template <typename T>
void DefKeywordInit(py::class_<T>& cls) {
  cls.def(py::init<>());
  py::handle type = cls;
  cls.def(py::init([type](const py::kwargs& kwargs) {
    py::object made = type();
    for (const auto& [key, value] : kwargs) {
      if (!py::hasattr(made, key)) {
        throw py::type_error(TypeName(made) + "() got an unexpected keyword argument '" +
                             py::str(key).cast<std::string>() + "'");
      }
      py::setattr(made, key, value);
    }
    return made.cast<T>();
  }));
}

template <typename T>
std::vector<T> ListOf(const py::iterable& items, const char* what, const char* type_name) {
  std::vector<T> out;
  for (py::handle item : items) {
    if (!py::isinstance<T>(item)) {
      Raise(absl::InvalidArgumentError(std::string(what) + " must be shardcoord." + type_name + ", got " +
                                       TypeName(item)));
    }
    out.push_back(item.cast<T>());
  }
  return out;
}

}  // namespace shardcoord::python

#endif  // SHARDCOORD_PYTHON_COMMON_H_
