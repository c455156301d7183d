// Classification of fully frozen multimodal modules (DESIGN 3, the seed's rules).
//
// A module is a candidate when the last component of its dotted path is a tower or
// projector name (the built-in lists plus names the user adds). The model is walked
// top-down; a module below an already picked one is not picked again. A candidate is
// controlled only when fully frozen: at least one parameter, none requiring grad.
// Trainable candidates keep normal sharding and never appear in decisions.
#ifndef SHARDCOORD_CLASSIFY_H_
#define SHARDCOORD_CLASSIFY_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardcoord/export.h"

namespace shardcoord {

enum class ModuleKind { kTower, kProjector };

// The built-in name lists, in the seed's order.
SHARDCOORD_EXPORT const std::vector<std::string>& BuiltinTowerNames();
SHARDCOORD_EXPORT const std::vector<std::string>& BuiltinProjectorNames();

struct ClassifyOptions {
  std::vector<std::string> extra_tower_names;
  std::vector<std::string> extra_projector_names;
};

// One module of the model as seen by a walker (LibTorch, a manifest file, a test).
// Parameter counts are the module's own plus all its descendants'.
struct ModuleNode {
  std::string path;            // Dotted path from the model root; "" is the root.
  int64_t num_params = 0;      // Parameter tensors in the subtree.
  int64_t num_trainable = 0;   // Those with requires_grad.
};

struct ClassifiedModule {
  std::string path;
  ModuleKind kind = ModuleKind::kTower;
  bool fully_frozen = false;  // false: a trainable candidate, left to normal sharding.
};

// Classifies `modules` (any order; parents need not precede children). Returns the
// picked candidates in path order, trainable ones included with fully_frozen = false so
// callers can log them. Controlled modules are those with fully_frozen = true.
SHARDCOORD_EXPORT std::vector<ClassifiedModule> ClassifyModules(
    const std::vector<ModuleNode>& modules, const ClassifyOptions& options = {});

// The kind a path's last component names, if any.
SHARDCOORD_EXPORT bool MatchModuleName(std::string_view path, const ClassifyOptions& options,
                                       ModuleKind* kind);

}  // namespace shardcoord

#endif  // SHARDCOORD_CLASSIFY_H_
