// What a worker connects with, bound: shardcoord.WorkerOptions is the C++ WorkerOptions
// (worker/include/shardcoord/worker.h) and shardcoord.TlsOptions its TlsFiles, with the same
// field names. Policies and fallbacks are names ("" for the coordinator's default), durations
// seconds; each value is checked when it is set (InvalidArgument), so an options object that
// exists holds only values the worker accepts.
#include <string>

#include "common.h"
#include "shardcoord/worker.h"

namespace shardcoord::python {
namespace {

py::tuple TlsFields(const TlsFiles& t) { return py::make_tuple(t.ca_file, t.cert_file, t.key_file, t.server_name); }

// For repr: the token is a secret, so only whether there is one shows.
py::tuple OptionFields(const WorkerOptions& o) {
  return py::make_tuple(o.coordinator_address, o.job_id, o.rank, o.world_size, o.group_size, py::cast(o.modules),
                        o.policy == Policy::kUnspecified ? "" : PolicyName(o.policy),
                        o.fallback == Fallback::kUnspecified ? "" : FallbackName(o.fallback), o.wrap_outer_model,
                        o.lookahead, o.memory_budget_bytes, absl::ToDoubleSeconds(o.connect_timeout),
                        absl::ToDoubleSeconds(o.reconnect_window), o.token.empty() ? "" : "***", py::cast(o.tls));
}

void BindTls(py::module_& m) {
  py::class_<TlsFiles> tls(m, "TlsOptions",
                           "TLS to a coordinator that serves it (PEM files); each empty field: "
                           "$SHARDCOORD_TLS_CA, _CERT, _KEY, _SERVER_NAME, else plaintext.");
  DefKeywordInit(tls);
  tls.def_readwrite("ca_file", &TlsFiles::ca_file, "CA that signed the coordinator's certificate: turns TLS on")
      .def_readwrite("cert_file", &TlsFiles::cert_file, "client certificate chain (mutual TLS), with key_file")
      .def_readwrite("key_file", &TlsFiles::key_file)
      .def_readwrite("server_name", &TlsFiles::server_name,
                     "name the certificate carries when it is not the host dialled");
  DefRepr<TlsFiles>(tls, {"ca_file", "cert_file", "key_file", "server_name"}, TlsFields);
}

// The fields that are checked or converted as they are set.
void DefCheckedOptions(py::class_<WorkerOptions>& cls) {
  cls.def_property(
         "modules", [](const WorkerOptions& o) { return py::cast(o.modules); },
         [](WorkerOptions& o, const py::iterable& v) { o.modules = ListOf<ModuleSpec>(v, "modules", "ModuleSpec"); },
         "the controlled modules (a list of ModuleSpec; assign a new list to change it)")
      .def_property(
          "policy", [](const WorkerOptions& o) { return o.policy == Policy::kUnspecified ? "" : PolicyName(o.policy); },
          [](WorkerOptions& o, const std::string& name) { o.policy = PolicyFromName(name); },
          "auto, per_layer, root or replicate; \"\": the coordinator's default")
      .def_property(
          "fallback",
          [](const WorkerOptions& o) { return o.fallback == Fallback::kUnspecified ? "" : FallbackName(o.fallback); },
          [](WorkerOptions& o, const std::string& name) { o.fallback = FallbackFromName(name); },
          "root, replicate or padded; \"\": the coordinator's default")
      .def_property(
          "lookahead", [](const WorkerOptions& o) { return o.lookahead; },
          [](WorkerOptions& o, int v) {
            if (v < 0) Raise(absl::InvalidArgumentError("lookahead must be >= 0 (0: the default, 4)"));
            o.lookahead = v;
          },
          "undecided plans allowed in flight; 0: the default (4)")
      .def_property(
          "memory_budget_bytes", [](const WorkerOptions& o) { return o.memory_budget_bytes; },
          [](WorkerOptions& o, int64_t v) {
            if (v < 0) Raise(absl::InvalidArgumentError("memory_budget_bytes must be >= 0"));
            o.memory_budget_bytes = v;
          },
          "for `auto` promotion; 0: unknown (no promotion)")
      .def_property(
          "connect_timeout", [](const WorkerOptions& o) { return absl::ToDoubleSeconds(o.connect_timeout); },
          [](WorkerOptions& o, double s) { o.connect_timeout = Seconds(s, "connect_timeout"); }, "seconds")
      .def_property(
          "reconnect_window", [](const WorkerOptions& o) { return absl::ToDoubleSeconds(o.reconnect_window); },
          [](WorkerOptions& o, double s) { o.reconnect_window = Seconds(s, "reconnect_window"); },
          "seconds the worker reconnects for when the coordinator goes away; 0: fail at once");
}

}  // namespace

void BindOptions(py::module_& m) {
  BindTls(m);
  py::class_<WorkerOptions> options(m, "WorkerOptions",
                                    "What a worker connects with: the C++ shardcoord::WorkerOptions. Built with "
                                    "keywords: WorkerOptions(job_id=..., rank=..., world_size=..., group_size=..., "
                                    "modules=[ModuleSpec, ...], ...).");
  DefKeywordInit(options);
  options.def_readwrite("coordinator_address", &WorkerOptions::coordinator_address, "HOST:PORT; \"\": $SHARDCOORD_ADDR")
      .def_readwrite("job_id", &WorkerOptions::job_id)
      .def_readwrite("rank", &WorkerOptions::rank)
      .def_readwrite("world_size", &WorkerOptions::world_size)
      .def_readwrite("group_size", &WorkerOptions::group_size, "shard groups are contiguous blocks of this many ranks")
      .def_readwrite("wrap_outer_model", &WorkerOptions::wrap_outer_model)
      .def_readwrite("token", &WorkerOptions::token, "a rank token; \"\": $SHARDCOORD_TOKEN or $SHARDCOORD_TOKEN_FILE")
      .def_readwrite("tls", &WorkerOptions::tls, "TlsOptions");
  DefCheckedOptions(options);
  DefRepr<WorkerOptions>(options,
                         {"coordinator_address", "job_id", "rank", "world_size", "group_size", "modules", "policy",
                          "fallback", "wrap_outer_model", "lookahead", "memory_budget_bytes", "connect_timeout",
                          "reconnect_window", "token", "tls"},
                         OptionFields);
}

}  // namespace shardcoord::python
