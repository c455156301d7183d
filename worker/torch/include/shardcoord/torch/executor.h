// The LibTorch executor (DESIGN 5): carries coordinator decisions out on the real frozen
// parameters of a torch::nn::Module. Built with SHARDCOORD_WITH_TORCH; builds against
// LibTorch 1.13 and 2.x.
//
// Frozen parameters of each unit (an entry of a controlled module's layer list, or the rest
// unit "": every parameter no layer holds, such as embeddings, norms and mergers, or the whole
// module when it has no layer list) are flattened into one buffer, padded to a multiple of the
// group size and sharded across the shard group: each rank keeps 1/G. Materialize = all-gather
// into a full buffer and point the parameters at views of it; release = drop the full buffer.
// Under per_layer the rest unit is gathered when the module's forward starts (BeginModule)
// and released when it ends (EndModule), the layers one at a time in between: peak is the
// rest plus one layer, and every rank gathers in the same order.
//
// Collective rule: every rank of the group calls the hooks below for the same microbatches
// in the same order, with the group's identical decision. That is what the coordinator
// guarantees: `per_layer` only when every rank calls the module the same number of times.
// `padded` (fallback padded, for divergent calls) is per_layer with every rank making the
// decision's `calls` passes: the rank makes the passes it will not make itself (its planned
// calls fewer) as gather-only passes, each gathering and releasing every unit in the order a
// forward does (the rest unit first, then the layers in manifest order). The padded modules
// form a chain in manifest order: BeginMicrobatch pads from the first one and stops at a module
// this rank still calls; the end of its last planned call (EndModule) goes on with the next.
// So the forward must run the padded modules in manifest order, all calls of one before the
// first call of the next, before any per_layer module (give Create and the coordinator the
// manifest in the order the forward calls the modules), and they must be the first users of
// the group's communicator in the microbatch. A call out of that order or beyond the plan gets
// FAILED_PRECONDITION from BeginModule, before it gathers; fewer calls than planned, from
// EndForward.
//
// Towers that train (DESIGN 10): a module opted in as trainable (ManifestOptions::trainable, which
// sets ModuleSpec::trainable) may hold trainable parameters, such as LoRA adapters on a frozen base.
// Only its frozen parameters are sharded; the trainable ones stay whole on every rank, and the
// trainer reduces their gradients with its other replicated parameters (zeros where a rank has
// none: under skip, or when it did not call the module). Its backward needs the frozen weights the
// forward gathered, so that stays gathered until EndBackward: under root the whole module, under
// per_layer every unit that ran while autograd recorded and whose output needs grad (all of them
// unless AfterUnit / EndModule get the output and it does not). The peak in backward is
// then root's (no re-gather in backward, as FSDP does); the all-gathers are per_layer's, identical
// on every rank. The coordinator decides a trainable module skip, per_layer or root only; padded
// and replicate are refused by BeginMicrobatch.
//
// Thread-safety: one trainer thread. Not copyable.
#ifndef SHARDCOORD_TORCH_EXECUTOR_H_
#define SHARDCOORD_TORCH_EXECUTOR_H_

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shardcoord/classify.h"
#include "shardcoord/communicator.h"
#include "shardcoord/types.h"

namespace shardcoord::torchx {

struct ManifestOptions {
  ClassifyOptions classify;
  // The descendant (dotted path) that holds a module's layer units; a module without it is
  // one unit. Parameters outside it form the rest unit "".
  std::string layer_list = "layers";
  // Towers and projectors with trainable parameters that are controlled too (their
  // ModuleSpec::trainable set): paths, or last components ("vision_tower"). `all_trainable`:
  // every one of them. Not opted in, a candidate with a trainable parameter is left out.
  std::vector<std::string> trainable;
  bool all_trainable = false;
};

// Walks the model and returns the controlled modules by the classification rules of DESIGN 3
// (fully frozen towers and projectors, and the trainable ones opted in), with parameter bytes
// and layer units, in path order. INVALID_ARGUMENT: a name in `options.trainable` that is no
// tower or projector of the model.
absl::StatusOr<std::vector<ModuleSpec>> BuildManifest(torch::nn::Module& model, const ManifestOptions& options = {});

// Bytes counted per rank for one controlled module.
struct ModuleBytes {
  int64_t shard = 0;       // Always resident: this rank's shards.
  int64_t resident = 0;    // Shards plus currently materialized full buffers.
  int64_t peak = 0;        // Highest `resident` so far.
  int64_t gathered = 0;    // Total bytes received by all-gathers.
};

class FrozenShardExecutor {
 public:
  // Shards the parameters of every unit of `manifest` in `model` over `group` (the
  // shard group's communicator; Gloo with CPU tensors, NCCL with CUDA tensors). All ranks
  // of the group must call it with the same model structure and manifest. Parameters are
  // empty until materialized (the trainable ones of a trainable module stay as they are).
  // Errors: INVALID_ARGUMENT (a module not in the model, mixed dtypes in a unit, a trainable
  // parameter in a module whose spec is not trainable).
  static absl::StatusOr<std::unique_ptr<FrozenShardExecutor>> Create(torch::nn::Module& model,
                                                                      std::vector<ModuleSpec> manifest,
                                                                      std::shared_ptr<Communicator> group);

  // At the always-run start of a microbatch, with the group's decision (first releasing what a
  // failed forward left gathered; local): `root` modules
  // are gathered whole now; `replicate` modules become resident (gathered once); `padded`
  // modules get their gather-only passes (decision calls minus this rank's `calls`, the calls
  // it planned for the microbatch); `skip` and `per_layer` do nothing yet. FAILED_PRECONDITION
  // when a padded module has no entry in `calls`, or more calls than the decision's passes
  // (the plan and the decision disagree), or a trainable module is decided padded or
  // replicate (an older coordinator); nothing was gathered then.
  absl::Status BeginMicrobatch(const MicrobatchDecision& decision,
                               const std::map<std::string, int32_t>& calls = {});
  // When the rank's call of a module starts and ends: `per_layer` gathers its rest unit ""
  // (or its one whole-module unit) and releases it; `skip` refuses BeginModule (the plan said
  // 0 calls); `padded` as per_layer, counting the calls (EndModule of the last planned one
  // makes the next padded module's passes): under padded every call must be opened and closed
  // with them, whether or not the module has a rest unit. Otherwise no-ops for modules without a
  // rest unit and for root / replicate.
  // `output` (optional): the module's output, for a trainable module under autograd (its rest
  // unit is kept for backward unless the output does not need grad; see the class comment).
  absl::Status BeginModule(const std::string& module);
  absl::Status EndModule(const std::string& module, const torch::Tensor& output = {});
  // Around each unit of a module the rank runs: `per_layer` gathers it before and releases
  // it after; other decisions need nothing. Unit index in the manifest's unit list of the
  // module (UnitIndex finds it by name). A layer before the module's rest unit is gathered
  // (BeginModule not called) is refused under per_layer: the order must be the same on
  // every rank. `output` (optional): the unit's output. For a trainable module under autograd
  // the unit is kept for backward unless it is given and does not need grad; for a frozen
  // module, an output that needs grad is refused under every decision (FAILED_PRECONDITION:
  // backward would need the weights the executor releases; run it under no_grad).
  absl::Status BeforeUnit(const std::string& module, int unit);
  absl::Status AfterUnit(const std::string& module, int unit, const torch::Tensor& output = {});
  // The index of `unit` in `module`'s unit list, or -1.
  int UnitIndex(const std::string& module, const std::string& unit) const;
  // After the forward of the microbatch: `root` modules are released (trainable ones stay
  // gathered for their backward, until EndBackward).
  absl::Status EndForward();
  // After the backward of the microbatch: releases what trainable modules kept for it. Local,
  // no collective; needed only with trainable modules (the next BeginMicrobatch releases what
  // is left otherwise, later). Replicated modules stay resident.
  absl::Status EndBackward();

  const std::map<std::string, ModuleBytes>& bytes() const { return bytes_; }
  int64_t peak_total_bytes() const { return peak_total_; }
  // The counts above in the form Worker::ReportMemory takes.
  std::vector<ModuleMemoryUsage> MemoryUsage() const {
    std::vector<ModuleMemoryUsage> out;
    for (const auto& [name, b] : bytes_) out.push_back({name, b.resident, b.peak, b.gathered});
    return out;
  }

 private:
  struct Param {
    torch::Tensor param;  // The module's parameter (its data is swapped).
    std::vector<int64_t> shape;
    int64_t offset = 0;   // In the unit's flat buffer.
    int64_t numel = 0;
  };
  struct Unit {
    std::string name;      // As in the manifest; "" is the rest unit.
    std::vector<Param> params;
    torch::Tensor shard;   // This rank's slice of the padded flat buffer.
    torch::Tensor full;    // Materialized flat buffer, or undefined.
    int64_t padded = 0;    // Elements in the full buffer.
  };
  struct Module {
    ModuleSpec spec;
    std::vector<Unit> units;
    Decision decision = Decision::kSkip;
    bool replicated = false;
    int32_t planned = 0;  // Padded: this rank's planned calls in the microbatch.
    int32_t done = 0;     // Padded: calls begun (BeginModule).
    int32_t pads = 0;     // Padded: the gather-only passes this rank makes.
    bool in_call = false;  // Padded: between BeginModule and EndModule.
    bool padded_out = false;  // Padded: those passes were made.
    bool kept = false;     // Trainable: units are kept gathered for the backward (EndBackward).
  };

  FrozenShardExecutor(std::shared_ptr<Communicator> group) : group_(std::move(group)) {}
  // Flattens the unit's parameters (checked by Create: frozen, one dtype and device), keeps
  // this rank's slice and frees the rest.
  Unit ShardUnit(const std::string& name, const std::vector<torch::Tensor>& params);
  static int RestIndex(const Module& m);
  absl::Status Materialize(Module& m, Unit& u);
  // This rank's gather-only passes for a padded module (checked by BeginMicrobatch).
  absl::StatusOr<int32_t> PadPasses(const Module& m, const ModuleDecision& d,
                                    const std::map<std::string, int32_t>& calls, const MicrobatchKey& key) const;
  absl::Status Pad(Module& m, int32_t passes);
  // The pad chain (see the class comment): from module `chain_` on, makes each padded module's
  // passes and stops at one this rank still calls.
  absl::Status AdvancePads();
  // A call of `m` that would gather in another order than the ranks that pad: before the chain
  // reached it, beyond its plan, or (per_layer) while padded calls are left.
  absl::Status CheckPaddedOrder(const Module& m) const;
  void Release(Module& m, Unit& u);
  // After a unit's forward: releases it under per_layer and padded, keeps it for the backward of
  // a trainable module, refuses a frozen unit whose output needs grad.
  absl::Status AfterForward(Module& m, Unit& u, const torch::Tensor& output);
  // FAILED_PRECONDITION when a frozen (not trainable) module's `output` needs grad under
  // autograd, naming `what` (a unit, or the module).
  absl::Status CheckFrozenOutput(const Module& m, const std::string& what, const torch::Tensor& output) const;
  void Account(Module& m, int64_t delta_bytes);
  Module* Find(const std::string& module);

  std::shared_ptr<Communicator> group_;
  std::vector<Module> modules_;
  size_t chain_ = 0;  // The pad chain's position in modules_ (modules_.size(): done).
  std::map<std::string, ModuleBytes> bytes_;
  int64_t resident_total_ = 0;
  int64_t peak_total_ = 0;
};

}  // namespace shardcoord::torchx

#endif  // SHARDCOORD_TORCH_EXECUTOR_H_
