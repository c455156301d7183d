#include "shardcoord/torch/executor.h"

#include <algorithm>
#include <set>

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

// The unit modules of a controlled module: its layer list's entries, or itself.
std::vector<std::pair<std::string, ModulePtr>> Units(const ModulePtr& module, const std::string& layer_list) {
  std::vector<std::pair<std::string, ModulePtr>> units;
  for (const auto& child : module->named_children()) {
    if (child.key() != layer_list) continue;
    for (const auto& entry : child.value()->named_children()) {
      units.emplace_back(layer_list + "." + entry.key(), entry.value());
    }
  }
  if (units.empty()) units.emplace_back("", module);  // Also when layer_list is "".
  return units;
}

int64_t ParamBytes(const torch::nn::Module& m) {
  int64_t bytes = 0;
  for (const auto& p : m.parameters(/*recurse=*/true)) bytes += p.numel() * static_cast<int64_t>(p.element_size());
  return bytes;
}

absl::StatusOr<DataType> ToDataType(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat32) return DataType::kFloat32;
  if (t.scalar_type() == torch::kFloat64) return DataType::kFloat64;
  return absl::InvalidArgumentError(absl::StrCat("frozen parameters of dtype ", std::string(c10::toString(t.scalar_type())),
                                                 " are not supported yet (float32, float64)"));
}

}  // namespace

std::vector<ModuleSpec> BuildManifest(torch::nn::Module& model, const ManifestOptions& options) {
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
  std::vector<ModuleSpec> out;
  for (const auto& c : ClassifyModules(nodes, options.classify)) {
    if (!c.fully_frozen) continue;
    const ModulePtr& m = modules.at(c.path);
    ModuleSpec spec;
    spec.name = c.path;
    spec.param_bytes = ParamBytes(*m);
    for (const auto& [name, unit] : Units(m, options.layer_list)) spec.units.push_back({name, ParamBytes(*unit)});
    out.push_back(std::move(spec));
  }
  return out;
}

absl::StatusOr<FrozenShardExecutor::Unit> FrozenShardExecutor::ShardUnit(const std::string& module,
                                                                         const std::string& unit_name,
                                                                         torch::nn::Module& unit_module) {
  const int64_t g = group_->size();
  const int64_t me = group_->rank();
  Unit u;
  std::vector<torch::Tensor> flat;
  int64_t offset = 0;
  torch::Tensor first;
  for (auto& p : unit_module.parameters(/*recurse=*/true)) {
    if (p.requires_grad()) {
      return absl::InvalidArgumentError(absl::StrCat("module '", module, "' has a trainable parameter in unit '",
                                                     unit_name, "': only fully frozen modules are controlled"));
    }
    if (!first.defined()) first = p;
    if (p.scalar_type() != first.scalar_type() || p.device() != first.device()) {
      return absl::InvalidArgumentError(absl::StrCat("unit '", unit_name, "' of '", module,
                                                     "' mixes dtypes or devices"));
    }
    if (auto dt = ToDataType(p); !dt.ok()) return dt.status();
    Param param{p, p.sizes().vec(), offset, p.numel()};
    flat.push_back(p.detach().reshape({-1}));
    offset += p.numel();
    u.params.push_back(std::move(param));
  }
  if (u.params.empty()) return u;
  const int64_t chunk = (offset + g - 1) / g;
  u.padded = chunk * g;
  torch::Tensor full = torch::zeros({u.padded}, first.options());
  full.narrow(0, 0, offset).copy_(torch::cat(flat));
  u.shard = full.narrow(0, me * chunk, chunk).clone();
  for (auto& param : u.params) param.param.set_data(torch::empty({0}, first.options()));
  return u;
}

absl::StatusOr<std::unique_ptr<FrozenShardExecutor>> FrozenShardExecutor::Create(torch::nn::Module& model,
                                                                                 std::vector<ModuleSpec> manifest,
                                                                                 std::shared_ptr<Communicator> group) {
  std::unique_ptr<FrozenShardExecutor> ex(new FrozenShardExecutor(std::move(group)));
  auto modules = ModulesByPath(model);
  torch::NoGradGuard no_grad;
  for (auto& spec : manifest) {
    auto it = modules.find(spec.name);
    if (it == modules.end()) {
      return absl::InvalidArgumentError(absl::StrCat("manifest module '", spec.name, "' is not in the model"));
    }
    Module mod;
    mod.spec = spec;
    // The manifest names the layer list ("layers.0" -> "layers"); "" is a whole-module unit.
    std::string layer_list;
    if (!spec.units.empty() && spec.units[0].name.find('.') != std::string::npos) {
      layer_list = spec.units[0].name.substr(0, spec.units[0].name.find('.'));
    }
    auto units = Units(it->second, layer_list);
    int64_t unit_params = 0;
    for (auto& [unit_name, unit_module] : units) unit_params += unit_module->parameters(true).size();
    if (unit_params != static_cast<int64_t>(it->second->parameters(true).size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "module '", spec.name, "' has parameters outside its layer list '", layer_list,
          "': put every parameter in a layer (or use no layer list) so each belongs to one unit"));
    }
    for (auto& [unit_name, unit_module] : units) {
      auto unit = ex->ShardUnit(spec.name, unit_name, *unit_module);
      if (!unit.ok()) return unit.status();
      if (unit->params.empty()) continue;
      const int64_t shard_bytes = unit->shard.numel() * static_cast<int64_t>(unit->shard.element_size());
      mod.units.push_back(*std::move(unit));
      ex->bytes_[spec.name].shard += shard_bytes;
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
  if (u.full.defined()) return absl::OkStatus();
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

absl::Status FrozenShardExecutor::BeginMicrobatch(const MicrobatchDecision& decision) {
  for (auto& m : modules_) {
    const ModuleDecision* d = decision.Find(m.spec.name);
    if (d == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("the decision for ", decision.key.ToString(),
                                                     " has no entry for module '", m.spec.name, "'"));
    }
    m.decision = d->decision;
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
  return absl::OkStatus();
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
  if (m->decision != Decision::kPerLayer) return absl::OkStatus();
  return Materialize(*m, m->units[unit]);
}

absl::Status FrozenShardExecutor::AfterUnit(const std::string& module, int unit) {
  Module* m = Find(module);
  if (m == nullptr || unit < 0 || unit >= static_cast<int>(m->units.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no unit ", unit, " of controlled module '", module, "'"));
  }
  if (m->decision == Decision::kPerLayer) Release(*m, m->units[unit]);
  return absl::OkStatus();
}

absl::Status FrozenShardExecutor::EndForward() {
  for (auto& m : modules_) {
    if (m.decision == Decision::kRoot) {
      for (auto& u : m.units) Release(m, u);
    }
  }
  return absl::OkStatus();
}

}  // namespace shardcoord::torchx
