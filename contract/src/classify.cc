#include "shardcoord/classify.h"

#include <algorithm>

namespace shardcoord {

const std::vector<std::string>& BuiltinTowerNames() {
  static const auto* names = new std::vector<std::string>{
      "visual",         "vision_tower",   "vision_model", "vit_model",   "image_encoder",
      "vision_encoder", "audio_tower",    "audio_encoder", "audio_model"};
  return *names;
}

const std::vector<std::string>& BuiltinProjectorNames() {
  static const auto* names = new std::vector<std::string>{
      "embed_vision",         "embed_audio",      "mm_projector",
      "multi_modal_projector", "multimodal_projector", "vision_projector",
      "vit_large_projector",  "audio_projector",  "connector"};  // Idefics3 / SmolVLM: model.connector
  return *names;
}

namespace {

std::string_view LastComponent(std::string_view path) {
  size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

bool Contains(const std::vector<std::string>& names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// True when `path` lies strictly below `ancestor` in the module tree.
bool IsBelow(std::string_view path, std::string_view ancestor) {
  if (ancestor.empty()) return !path.empty();
  return path.size() > ancestor.size() && path.substr(0, ancestor.size()) == ancestor &&
         path[ancestor.size()] == '.';
}

int Depth(std::string_view path) {
  if (path.empty()) return 0;
  return 1 + static_cast<int>(std::count(path.begin(), path.end(), '.'));
}

}  // namespace

bool MatchModuleName(std::string_view path, const ClassifyOptions& options, ModuleKind* kind) {
  std::string_view last = LastComponent(path);
  if (last.empty()) return false;
  if (Contains(BuiltinTowerNames(), last) || Contains(options.extra_tower_names, last)) {
    *kind = ModuleKind::kTower;
    return true;
  }
  if (Contains(BuiltinProjectorNames(), last) ||
      Contains(options.extra_projector_names, last)) {
    *kind = ModuleKind::kProjector;
    return true;
  }
  return false;
}

std::vector<ClassifiedModule> ClassifyModules(const std::vector<ModuleNode>& modules,
                                              const ClassifyOptions& options) {
  // Top-down: shallower paths first, so an ancestor is picked before its descendants.
  std::vector<const ModuleNode*> order;
  order.reserve(modules.size());
  for (const auto& m : modules) order.push_back(&m);
  std::stable_sort(order.begin(), order.end(), [](const ModuleNode* a, const ModuleNode* b) {
    int da = Depth(a->path), db = Depth(b->path);
    return da != db ? da < db : a->path < b->path;
  });

  std::vector<ClassifiedModule> picked;
  for (const ModuleNode* m : order) {
    ModuleKind kind;
    if (!MatchModuleName(m->path, options, &kind)) continue;
    bool under_picked = std::any_of(picked.begin(), picked.end(), [&](const ClassifiedModule& p) {
      return IsBelow(m->path, p.path);
    });
    if (under_picked) continue;
    ClassifiedModule c;
    c.path = m->path;
    c.kind = kind;
    c.fully_frozen = m->num_params > 0 && m->num_trainable == 0;
    picked.push_back(std::move(c));
  }
  std::sort(picked.begin(), picked.end(),
            [](const ClassifiedModule& a, const ClassifiedModule& b) { return a.path < b.path; });
  return picked;
}

}  // namespace shardcoord
