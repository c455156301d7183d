#include "shardcoord/torch/executor.h"

#include <algorithm>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardcoord::torchx {
namespace {

using ModulePtr = std::shared_ptr<torch::nn::Module>;

std::map<std::string, ModulePtr> ModulesByPath(torch::nn::Module& model) {
  std::map<std::string, ModulePtr> out;
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    out[item.key()] = item.value();
  }
  return out;
}

// The entries of a controlled module's layer list (a dotted path below it), or none.
std::vector<std::pair<std::string, ModulePtr>> LayerUnits(const ModulePtr& module, const std::string& layer_list) {
  std::vector<std::pair<std::string, ModulePtr>> units;
  if (layer_list.empty()) return units;
  for (const auto& item : module->named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (item.key() != layer_list) continue;
    for (const auto& entry : item.value()->named_children()) {
      units.emplace_back(layer_list + "." + entry.key(), entry.value());
    }
  }
  return units;
}

// The parameters of `module` that none of `units` holds, in named_parameters order (the rest
// unit ""). `shared` gets the names of parameters that two units hold.
std::vector<std::pair<std::string, torch::Tensor>> RestParams(
    const ModulePtr& module, const std::vector<std::pair<std::string, ModulePtr>>& units,
    std::vector<std::string>* shared) {
  std::map<const void*, int> owners;
  for (const auto& [name, unit] : units) {
    for (const auto& p : unit->parameters(/*recurse=*/true)) owners[p.unsafeGetTensorImpl()]++;
  }
  std::vector<std::pair<std::string, torch::Tensor>> rest;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    auto it = owners.find(item.value().unsafeGetTensorImpl());
    if (it == owners.end()) {
      rest.emplace_back(item.key(), item.value());
    } else if (it->second > 1 && shared != nullptr) {
      shared->push_back(item.key());
    }
  }
  return rest;
}

int64_t Bytes(const std::vector<torch::Tensor>& params) {
  int64_t bytes = 0;
  for (const auto& p : params) bytes += p.numel() * static_cast<int64_t>(p.element_size());
  return bytes;
}

int64_t ParamBytes(const torch::nn::Module& m) { return Bytes(m.parameters(/*recurse=*/true)); }

absl::StatusOr<DataType> ToDataType(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat32) return DataType::kFloat32;
  if (t.scalar_type() == torch::kFloat64) return DataType::kFloat64;
  return absl::InvalidArgumentError(absl::StrCat("frozen parameters of dtype ", std::string(c10::toString(t.scalar_type())),
                                                 " are not supported yet (float32, float64)"));
}

// Whether `name` names the module at `path`: the path itself, or its last components
// ("vision_tower" for "model.vision_tower").
bool Names(const std::string& name, const std::string& path) {
  return path == name || absl::EndsWith(path, absl::StrCat(".", name));
}

// Whether the candidate at `path` is opted in as trainable (ManifestOptions::trainable).
bool OptedIn(const std::string& path, const ManifestOptions& options) {
  return options.all_trainable || std::any_of(options.trainable.begin(), options.trainable.end(),
                                              [&](const std::string& t) { return Names(t, path); });
}

// Whether the backward may need what a forward that gave `output` used: autograd records it, and
// the output (when given) needs grad.
bool BackwardNeeds(const torch::Tensor& output) {
  return torch::GradMode::is_enabled() && (!output.defined() || output.requires_grad());
}

}  // namespace

absl::StatusOr<std::vector<ModuleSpec>> BuildManifest(torch::nn::Module& model, const ManifestOptions& options) {
  std::vector<ModuleNode> nodes;
  auto modules = ModulesByPath(model);
  for (const auto& [path, m] : modules) {
    ModuleNode n;
    n.path = path;
    for (const auto& p : m->parameters(/*recurse=*/true)) {
      n.num_params++;
      if (p.requires_grad()) n.num_trainable++;
    }
    nodes.push_back(std::move(n));
  }
  const std::vector<ClassifiedModule> classified = ClassifyModules(nodes, options.classify);
  for (const auto& t : options.trainable) {
    if (std::none_of(classified.begin(), classified.end(), [&](const auto& c) { return Names(t, c.path); })) {
      return absl::InvalidArgumentError(absl::StrCat(
          "trainable name '", t, "' is no tower or projector of the model: give a path or last component of "
          "one (the tower and projector names, or ManifestOptions::classify's extra names)"));
    }
  }
  std::vector<ModuleSpec> out;
  for (const auto& c : classified) {
    const ModulePtr& m = modules.at(c.path);
    // Left to the trainer (no decisions): a trainable candidate not opted in, or one without parameters.
    if (!c.fully_frozen && (!OptedIn(c.path, options) || m->parameters().empty())) continue;
    ModuleSpec spec;
    spec.name = c.path;
    spec.param_bytes = ParamBytes(*m);
    spec.trainable = !c.fully_frozen;
    // The rest unit "" first (what no layer holds; the whole module without layers), then the layers.
    const auto layers = LayerUnits(m, options.layer_list);
    std::vector<torch::Tensor> rest;
    for (auto& [name, p] : RestParams(m, layers, nullptr)) rest.push_back(p);
    if (!rest.empty() || layers.empty()) spec.units.push_back({"", Bytes(rest)});
    for (const auto& [name, unit] : layers) spec.units.push_back({name, ParamBytes(*unit)});
    out.push_back(std::move(spec));
  }
  return out;
}

namespace {

// The parameters of one unit that the executor shards, in order.
struct UnitParams {
  std::string name;
  std::vector<torch::Tensor> params;
};

// The frozen parameters of one unit, checked: none trainable unless the module is (its trainable
// ones then stay whole), one supported dtype and one device.
absl::StatusOr<UnitParams> CheckUnit(const ModuleSpec& spec, const std::string& unit_name,
                                     const std::vector<torch::Tensor>& params) {
  UnitParams out{unit_name, {}};
  for (const auto& p : params) {
    if (p.requires_grad() && spec.trainable) continue;  // An adapter: whole on every rank.
    if (p.requires_grad()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "module '", spec.name, "' has a trainable parameter in unit '", unit_name, "': only fully frozen modules ",
          "are controlled, and those opted in as trainable (ManifestOptions::trainable sets ModuleSpec::trainable)"));
    }
    if (!out.params.empty() &&
        (p.scalar_type() != out.params[0].scalar_type() || p.device() != out.params[0].device())) {
      return absl::InvalidArgumentError(absl::StrCat("unit '", unit_name, "' of '", spec.name,
                                                     "' mixes dtypes or devices"));
    }
    if (auto dt = ToDataType(p); !dt.ok()) return dt.status();
    out.params.push_back(p);
  }
  return out;
}

// The units of a manifest module in the model, in the manifest's order ("" is the rest unit:
// every parameter that no named unit holds, the whole module when it is the only unit), checked.
absl::StatusOr<std::vector<UnitParams>> ModuleUnits(const ModuleSpec& spec, const ModulePtr& module) {
  std::vector<std::string> names;
  for (const auto& u : spec.units) names.push_back(u.name);
  if (names.empty()) names.push_back("");
  std::vector<std::pair<std::string, ModulePtr>> layers;
  const auto children = ModulesByPath(*module);
  for (const auto& name : names) {
    if (name.empty()) continue;
    auto child = children.find(name);
    if (child == children.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unit '", name, "' of manifest module '", spec.name, "' is not in the model"));
    }
    layers.emplace_back(name, child->second);
  }
  std::vector<std::string> shared;
  const auto rest = RestParams(module, layers, &shared);
  const bool has_rest = std::find(names.begin(), names.end(), "") != names.end();
  if (std::set<std::string>(names.begin(), names.end()).size() != names.size()) {
    return absl::InvalidArgumentError(absl::StrCat("manifest module '", spec.name, "' lists a unit twice"));
  }
  if (!shared.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("module '", spec.name, "' has parameters shared by several units: '",
                                                   shared.front(), "'; each parameter must belong to exactly one"));
  }
  if (!rest.empty() && !has_rest) {
    return absl::InvalidArgumentError(absl::StrCat(
        "module '", spec.name, "' has parameters outside the units its manifest names ('", rest.front().first,
        "', ...): list the rest unit \"\" (BuildManifest does), which holds them"));
  }
  std::vector<UnitParams> out;
  for (const auto& name : names) {
    std::vector<torch::Tensor> params;
    if (name.empty()) {
      for (const auto& [pname, p] : rest) params.push_back(p);
    } else {
      for (const auto& [lname, unit] : layers) {
        if (lname == name) params = unit->parameters(/*recurse=*/true);
      }
    }
    auto unit = CheckUnit(spec, name, params);
    if (!unit.ok()) return unit.status();
    out.push_back(*std::move(unit));
  }
  return out;
}

}  // namespace

FrozenShardExecutor::Unit FrozenShardExecutor::ShardUnit(const std::string& name,
                                                         const std::vector<torch::Tensor>& params) {
  const int64_t g = group_->size();
  const int64_t me = group_->rank();
  Unit u;
  u.name = name;
  if (params.empty()) return u;
  std::vector<torch::Tensor> flat;
  int64_t offset = 0;
  for (const auto& p : params) {
    u.params.push_back(Param{p, p.sizes().vec(), offset, p.numel()});
    flat.push_back(p.detach().reshape({-1}));
    offset += p.numel();
  }
  const int64_t chunk = (offset + g - 1) / g;
  u.padded = chunk * g;
  torch::Tensor full = torch::zeros({u.padded}, params[0].options());
  full.narrow(0, 0, offset).copy_(torch::cat(flat));
  u.shard = full.narrow(0, me * chunk, chunk).clone();
  for (auto& param : u.params) param.param.set_data(torch::empty({0}, params[0].options()));
  return u;
}

absl::StatusOr<std::unique_ptr<FrozenShardExecutor>> FrozenShardExecutor::Create(torch::nn::Module& model,
                                                                                 std::vector<ModuleSpec> manifest,
                                                                                 std::shared_ptr<Communicator> group) {
  std::unique_ptr<FrozenShardExecutor> ex(new FrozenShardExecutor(std::move(group)));
  auto modules = ModulesByPath(model);
  torch::NoGradGuard no_grad;
  // Every module is checked before any parameter is sharded: a refused manifest leaves the model whole.
  std::vector<std::vector<UnitParams>> units;
  for (const auto& spec : manifest) {
    auto it = modules.find(spec.name);
    if (it == modules.end()) {
      return absl::InvalidArgumentError(absl::StrCat("manifest module '", spec.name, "' is not in the model"));
    }
    auto checked = ModuleUnits(spec, it->second);
    if (!checked.ok()) return checked.status();
    units.push_back(*std::move(checked));
  }
  for (size_t i = 0; i < manifest.size(); ++i) {
    Module mod;
    mod.spec = std::move(manifest[i]);
    for (const auto& unit : units[i]) {
      // A unit without parameters stays in the list (indices are the manifest's) and gathers nothing.
      mod.units.push_back(ex->ShardUnit(unit.name, unit.params));
      const Unit& u = mod.units.back();
      const int64_t shard_bytes = u.params.empty() ? 0 : u.shard.numel() * static_cast<int64_t>(u.shard.element_size());
      ex->bytes_[mod.spec.name].shard += shard_bytes;
      ex->Account(mod, shard_bytes);
    }
    ex->modules_.push_back(std::move(mod));
  }
  return ex;
}

void FrozenShardExecutor::Account(Module& m, int64_t delta) {
  ModuleBytes& b = bytes_[m.spec.name];
  b.resident += delta;
  b.peak = std::max(b.peak, b.resident);
  resident_total_ += delta;
  peak_total_ = std::max(peak_total_, resident_total_);
}

FrozenShardExecutor::Module* FrozenShardExecutor::Find(const std::string& module) {
  for (auto& m : modules_) {
    if (m.spec.name == module) return &m;
  }
  return nullptr;
}

absl::Status FrozenShardExecutor::Materialize(Module& m, Unit& u) {
  if (u.full.defined() || u.params.empty()) return absl::OkStatus();
  torch::NoGradGuard no_grad;
  torch::Tensor full = torch::empty({u.padded}, u.shard.options());
  auto dt = ToDataType(u.shard);
  if (!dt.ok()) return dt.status();
  absl::Status s = group_->AllGather(u.shard.data_ptr(), full.data_ptr(), u.shard.numel(), *dt);
  if (!s.ok()) return s;
  for (auto& p : u.params) p.param.set_data(full.narrow(0, p.offset, p.numel).view(p.shape));
  u.full = full;
  const int64_t bytes = u.padded * static_cast<int64_t>(full.element_size());
  bytes_[m.spec.name].gathered += bytes;
  Account(m, bytes);
  return absl::OkStatus();
}

void FrozenShardExecutor::Release(Module& m, Unit& u) {
  if (!u.full.defined()) return;
  for (auto& p : u.params) p.param.set_data(torch::empty({0}, u.shard.options()));
  Account(m, -u.padded * static_cast<int64_t>(u.full.element_size()));
  u.full = torch::Tensor();
}

absl::StatusOr<int32_t> FrozenShardExecutor::PadPasses(const Module& m, const ModuleDecision& d,
                                                       const std::map<std::string, int32_t>& calls,
                                                       const MicrobatchKey& key) const {
  auto own = calls.find(m.spec.name);
  if (own == calls.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "module '", m.spec.name, "' is decided `padded` (", d.calls, " passes) for ", key.ToString(),
        " but BeginMicrobatch got no planned calls for it: pass this rank's planned calls of the microbatch"));
  }
  if (own->second < 0 || own->second > d.calls) {
    return absl::FailedPreconditionError(absl::StrCat(
        "module '", m.spec.name, "': this rank planned ", own->second, " calls for ", key.ToString(),
        " but the group's `padded` decision has ", d.calls, " passes: give the calls this rank reported"));
  }
  return d.calls - own->second;
}

absl::Status FrozenShardExecutor::Pad(Module& m, int32_t passes) {
  const int rest = RestIndex(m);
  for (int32_t pass = 0; pass < passes; ++pass) {
    if (rest >= 0) {
      if (absl::Status s = Materialize(m, m.units[rest]); !s.ok()) return s;
    }
    for (size_t i = 0; i < m.units.size(); ++i) {
      if (static_cast<int>(i) == rest) continue;
      if (absl::Status s = Materialize(m, m.units[i]); !s.ok()) return s;
      Release(m, m.units[i]);
    }
    if (rest >= 0) Release(m, m.units[rest]);
  }
  return absl::OkStatus();
}

absl::Status FrozenShardExecutor::BeginMicrobatch(const MicrobatchDecision& decision,
                                                  const std::map<std::string, int32_t>& calls) {
  std::vector<int32_t> pads(modules_.size(), 0);
  for (size_t i = 0; i < modules_.size(); ++i) {  // Everything is checked before anything is gathered.
    const ModuleDecision* d = decision.Find(modules_[i].spec.name);
    if (d == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("the decision for ", decision.key.ToString(),
                                                     " has no entry for module '", modules_[i].spec.name, "'"));
    }
    if (modules_[i].spec.trainable && (d->decision == Decision::kPadded || d->decision == Decision::kReplicate)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "trainable module '", modules_[i].spec.name, "' is decided `", DecisionName(d->decision), "` for ",
          decision.key.ToString(), ": a coordinator decides a trainable module skip, per_layer or root only (its ",
          "backward needs what the forward gathered); this one predates trainable modules: run the shardcoordd of ",
          "this library's version"));
    }
    if (d->decision != Decision::kPadded) continue;
    absl::StatusOr<int32_t> passes = PadPasses(modules_[i], *d, calls, decision.key);
    if (!passes.ok()) return passes.status();
    pads[i] = *passes;
  }
  for (size_t i = 0; i < modules_.size(); ++i) {
    Module& m = modules_[i];
    const ModuleDecision* d = decision.Find(m.spec.name);
    if (!m.replicated) {
      // What a forward that failed before EndForward left gathered: a gathered unit would skip
      // its next all-gather on this rank alone (releasing is local, no collective).
      for (auto& u : m.units) Release(m, u);
    }
    m.decision = d->decision;
    m.done = 0;
    m.in_call = false;
    m.pads = pads[i];
    m.planned = m.decision == Decision::kPadded ? d->calls - pads[i] : 0;
    m.padded_out = false;
    m.kept = false;
    if (m.decision != Decision::kReplicate && m.replicated) {
      // Demoted by `auto`: back to sharded from this microbatch on (local, no collective).
      for (auto& u : m.units) Release(m, u);
      m.replicated = false;
    }
    if (m.decision == Decision::kRoot || (m.decision == Decision::kReplicate && !m.replicated)) {
      for (auto& u : m.units) {
        if (absl::Status s = Materialize(m, u); !s.ok()) return s;
      }
      m.replicated = m.decision == Decision::kReplicate;
    }
  }
  chain_ = 0;  // Root and replicate gathered above on every rank; the padded modules' passes next.
  return AdvancePads();
}

absl::Status FrozenShardExecutor::BeforeUnit(const std::string& module, int unit) {
  Module* m = Find(module);
  if (m == nullptr || unit < 0 || unit >= static_cast<int>(m->units.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no unit ", unit, " of controlled module '", module, "'"));
  }
  if (m->decision == Decision::kSkip) {
    return absl::FailedPreconditionError(absl::StrCat("module '", module, "' is decided `skip` for this microbatch, "
                                                      "but this rank runs it: its plan said 0 calls"));
  }
  if (m->decision != Decision::kPerLayer && m->decision != Decision::kPadded) return absl::OkStatus();
  if (m->decision == Decision::kPadded && !m->in_call) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unit ", unit, " ('", m->units[unit].name, "') of padded module '", module, "' runs outside BeginModule/"
        "EndModule: under padded each call must be opened with BeginModule (it counts the calls and orders the "
        "padded modules' passes) and closed with EndModule"));
  }
  // Beside layer units, the rest unit is gathered from BeginModule on: a layer before it is refused.
  const int rest = m->units.size() > 1 ? RestIndex(*m) : -1;
  if (rest >= 0 && unit != rest && !m->units[rest].params.empty() && !m->units[rest].full.defined()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unit ", unit, " ('", m->units[unit].name, "') of '", module, "' runs before the module's rest unit (its "
        "parameters outside the layer list) is gathered: call BeginModule when the module's forward starts"));
  }
  return Materialize(*m, m->units[unit]);
}

absl::Status FrozenShardExecutor::AfterUnit(const std::string& module, int unit, const torch::Tensor& output) {
  Module* m = Find(module);
  if (m == nullptr || unit < 0 || unit >= static_cast<int>(m->units.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no unit ", unit, " of controlled module '", module, "'"));
  }
  return AfterForward(*m, m->units[unit], output);
}

absl::Status FrozenShardExecutor::CheckFrozenOutput(const Module& m, const std::string& what,
                                                    const torch::Tensor& output) const {
  if (m.spec.trainable || !output.defined() || !BackwardNeeds(output)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, " of '", m.spec.name, "' produced an output that requires grad, so backward would need its weights, but ",
      "the executor releases a frozen module's weights after its forward (per_layer, padded) or at EndForward ",
      "(root): run the frozen module under torch::NoGradGuard (its inputs must not require grad); a frozen module ",
      "that gradients must flow through (one after a trainable module) cannot be controlled: leave it out of the ",
      "manifest"));
}

absl::Status FrozenShardExecutor::AfterForward(Module& m, Unit& u, const torch::Tensor& output) {
  // Refused under every decision alike, so that a model does not work or fail by the microbatch's.
  absl::Status frozen =
      CheckFrozenOutput(m, u.name.empty() ? std::string("the rest unit") : absl::StrCat("unit '", u.name, "'"), output);
  if (m.decision != Decision::kPerLayer && m.decision != Decision::kPadded) return frozen;
  if (m.spec.trainable && BackwardNeeds(output)) {
    m.kept = true;  // Its backward needs the frozen weights: kept until EndBackward, on every rank alike.
    return absl::OkStatus();
  }
  Release(m, u);
  return frozen;
}

absl::Status FrozenShardExecutor::AdvancePads() {
  for (; chain_ < modules_.size(); ++chain_) {
    Module& m = modules_[chain_];
    if (m.decision != Decision::kPadded) continue;
    if (!m.padded_out) {
      m.padded_out = true;
      if (absl::Status s = Pad(m, m.pads); !s.ok()) return s;
    }
    if (m.done < m.planned) break;  // This rank's own calls come next.
  }
  return absl::OkStatus();
}

absl::Status FrozenShardExecutor::CheckPaddedOrder(const Module& m) const {
  const size_t index = static_cast<size_t>(&m - modules_.data());
  if (m.decision == Decision::kPadded && m.done >= m.planned) {
    return absl::FailedPreconditionError(absl::StrCat(
        "padded module '", m.spec.name, "' is called more often than the ", m.planned, " calls this rank planned: ",
        "the other ranks padded to the plan, so this call would gather alone; run the calls this rank reported"));
  }
  const bool padded_left = chain_ < modules_.size();
  const bool in_order = m.decision == Decision::kPadded ? chain_ >= index : !padded_left;
  if (in_order || (m.decision != Decision::kPadded && m.decision != Decision::kPerLayer)) return absl::OkStatus();
  const Module& waiting = modules_[chain_];
  return absl::FailedPreconditionError(absl::StrCat(
      "module '", m.spec.name, "' is called while padded module '", waiting.spec.name, "' has ",
      waiting.planned - waiting.done, " of its ", waiting.planned, " planned calls left: the ranks that pad gather ",
      "the padded modules first, module by module in manifest order; run every call of '", waiting.spec.name,
      "' first, or give the manifest in the order the forward calls the modules"));
}

absl::Status FrozenShardExecutor::BeginModule(const std::string& module) {
  Module* m = Find(module);
  if (m == nullptr) return absl::InvalidArgumentError(absl::StrCat("no controlled module '", module, "'"));
  if (absl::Status s = CheckPaddedOrder(*m); !s.ok()) return s;
  if (m->decision == Decision::kPadded) {
    ++m->done;
    m->in_call = true;
  }
  const int rest = RestIndex(*m);
  if (rest < 0) return m->decision == Decision::kSkip ? BeforeUnit(module, 0) : absl::OkStatus();
  return BeforeUnit(module, rest);
}

absl::Status FrozenShardExecutor::EndModule(const std::string& module, const torch::Tensor& output) {
  Module* m = Find(module);
  if (m == nullptr) return absl::InvalidArgumentError(absl::StrCat("no controlled module '", module, "'"));
  const int rest = RestIndex(*m);
  const absl::Status status =
      rest >= 0 ? AfterForward(*m, m->units[rest], output) : CheckFrozenOutput(*m, "the module", output);
  m->in_call = false;
  // The last planned call of a padded module: the chain goes on with the next one's passes (even
  // after a refusal above, so that this rank's all-gathers still pair with the group's).
  const absl::Status next =
      m->decision == Decision::kPadded && m->done == m->planned ? AdvancePads() : absl::OkStatus();
  return status.ok() ? next : status;
}

int FrozenShardExecutor::RestIndex(const Module& m) {
  for (size_t i = 0; i < m.units.size(); ++i) {
    if (m.units[i].name.empty()) return static_cast<int>(i);
  }
  return -1;
}

int FrozenShardExecutor::UnitIndex(const std::string& module, const std::string& unit) const {
  for (const auto& m : modules_) {
    if (m.spec.name != module) continue;
    for (size_t i = 0; i < m.units.size(); ++i) {
      if (m.units[i].name == unit) return static_cast<int>(i);
    }
  }
  return -1;
}

absl::Status FrozenShardExecutor::EndForward() {
  absl::Status status;
  for (auto& m : modules_) {
    if (m.decision == Decision::kPadded && m.done != m.planned && status.ok()) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "padded module '", m.spec.name, "' was called ", m.done, " times but this rank planned ", m.planned,
          ": the group's all-gathers no longer match (the other ranks padded to the planned calls); give "
          "BeginMicrobatch the calls this rank reported and run exactly those"));
    }
    if (m.spec.trainable && m.decision == Decision::kRoot) {
      m.kept = true;  // Its backward needs the frozen weights: released by EndBackward.
    } else if (m.decision == Decision::kRoot || m.decision == Decision::kPadded) {
      for (auto& u : m.units) Release(m, u);
    }
  }
  return status;
}

absl::Status FrozenShardExecutor::EndBackward() {
  for (auto& m : modules_) {
    if (!m.kept) continue;
    for (auto& u : m.units) Release(m, u);
    m.kept = false;
  }
  return absl::OkStatus();
}

}  // namespace shardcoord::torchx
