// Unit tests of the LibTorch executor: the manifest a model yields (classification rules on
// real torch::nn::Modules), and materialize / release per decision, with a one-member
// loopback communicator as the seam (the multi-process trainer tests use real Gloo).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "shardcoord/torch/executor.h"

namespace shardcoord::torchx {
namespace {

using ::testing::HasSubstr;

// A group of one: all-gather is a copy. Counts the collectives it was asked for.
class LoopbackCommunicator final : public Communicator {
 public:
  LoopbackCommunicator() : Communicator("loopback", 1, 0, {0}) {}
  absl::Status Health() const override { return absl::OkStatus(); }
  absl::Status AllGather(const void* in, void* out, size_t count, DataType type) override {
    ++gathers;
    counts.push_back(count);
    std::memcpy(out, in, count * DataTypeSize(type));
    return absl::OkStatus();
  }
  absl::Status AllReduce(void*, size_t, DataType, ReduceOp) override { return absl::OkStatus(); }
  absl::Status Broadcast(void*, size_t, DataType, int) override { return absl::OkStatus(); }
  absl::Status Barrier() override { return absl::OkStatus(); }
  int gathers = 0;
  std::vector<size_t> counts;  // Elements of each all-gather, in order.
};

struct TowerImpl : torch::nn::Module {
  torch::nn::ModuleList layers;
  TowerImpl() {
    layers = register_module("layers", torch::nn::ModuleList(torch::nn::Linear(4, 3), torch::nn::Linear(3, 3)));
  }
};
TORCH_MODULE(Tower);

struct NestedImpl : torch::nn::Module {
  torch::nn::Linear vision_model{nullptr};
  NestedImpl() { vision_model = register_module("vision_model", torch::nn::Linear(2, 2)); }
};
TORCH_MODULE(Nested);

struct ModelImpl : torch::nn::Module {
  Tower vision_tower;
  Nested audio_tower;
  torch::nn::Linear multi_modal_projector{nullptr}, head{nullptr}, my_adapter{nullptr};
  ModelImpl() {
    vision_tower = register_module("vision_tower", Tower());
    audio_tower = register_module("audio_tower", Nested());
    multi_modal_projector = register_module("multi_modal_projector", torch::nn::Linear(3, 3));
    head = register_module("head", torch::nn::Linear(3, 2));
    my_adapter = register_module("my_adapter", torch::nn::Linear(2, 2));
    for (auto* m : std::vector<torch::nn::Module*>{vision_tower.get(), audio_tower.get(), my_adapter.get()}) {
      for (auto& p : m->parameters()) p.set_requires_grad(false);
    }
    // The projector stays trainable: it keeps normal sharding, never a decision.
  }
};
TORCH_MODULE(Model);

TEST(BuildManifestTest, FollowsTheClassificationRules) {
  torch::manual_seed(0);
  Model model;
  auto manifest = *BuildManifest(*model);
  ASSERT_EQ(manifest.size(), 2u);
  EXPECT_EQ(manifest[0].name, "audio_tower");  // picked; its vision_model child is not
  ASSERT_EQ(manifest[0].units.size(), 1u);     // no layer list: one whole-module unit
  EXPECT_EQ(manifest[0].units[0].name, "");
  EXPECT_EQ(manifest[0].param_bytes, (2 * 2 + 2) * 4);
  EXPECT_EQ(manifest[1].name, "vision_tower");
  ASSERT_EQ(manifest[1].units.size(), 2u);
  EXPECT_EQ(manifest[1].units[0].name, "layers.0");
  EXPECT_EQ(manifest[1].units[0].param_bytes, (4 * 3 + 3) * 4);
  EXPECT_EQ(manifest[1].param_bytes, ((4 * 3 + 3) + (3 * 3 + 3)) * 4);

  ManifestOptions extra;
  extra.classify.extra_projector_names = {"my_adapter"};
  auto with_extra = *BuildManifest(*model, extra);
  ASSERT_EQ(with_extra.size(), 3u);
  EXPECT_EQ(with_extra[1].name, "my_adapter");
}

TEST(FrozenShardExecutorTest, MaterializesExactlyAndReleasesPerDecision) {
  torch::manual_seed(0);
  Model model;
  auto manifest = *BuildManifest(*model);
  std::vector<torch::Tensor> original;
  for (auto& p : model->vision_tower->parameters()) original.push_back(p.detach().clone());
  auto comm = std::make_shared<LoopbackCommunicator>();
  auto ex = FrozenShardExecutor::Create(*model, manifest, comm);
  ASSERT_TRUE(ex.ok()) << ex.status();
  for (auto& p : model->vision_tower->parameters()) EXPECT_EQ(p.numel(), 0) << "sharded away until needed";

  auto decision = [](Decision vision, Decision audio) {
    MicrobatchDecision d;
    d.modules = {{"audio_tower", audio, DecisionReason::kUniform}, {"vision_tower", vision, DecisionReason::kUniform}};
    return d;
  };
  // root: everything gathered at the start, bitwise the original values, released after.
  ASSERT_TRUE((*ex)->BeginMicrobatch(decision(Decision::kRoot, Decision::kSkip)).ok());
  auto params = model->vision_tower->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], original[i])) << i;
  EXPECT_EQ(comm->gathers, 2);
  ASSERT_TRUE((*ex)->EndForward().ok());
  for (auto& p : model->vision_tower->parameters()) EXPECT_EQ(p.numel(), 0);

  // per_layer: only the unit about to run.
  ASSERT_TRUE((*ex)->BeginMicrobatch(decision(Decision::kPerLayer, Decision::kSkip)).ok());
  ASSERT_TRUE((*ex)->BeforeUnit("vision_tower", 1).ok());
  EXPECT_EQ(model->vision_tower->layers[0]->parameters()[0].numel(), 0);
  EXPECT_TRUE(torch::equal(model->vision_tower->layers[1]->parameters()[0], original[2]));
  ASSERT_TRUE((*ex)->AfterUnit("vision_tower", 1).ok());
  EXPECT_EQ(model->vision_tower->layers[1]->parameters()[0].numel(), 0);

  // skip: running the module anyway is a precise error, not a silent wrong result.
  absl::Status s = (*ex)->BeforeUnit("audio_tower", 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("'audio_tower' is decided `skip`"));

  // replicate: gathered once, then resident.
  const int before = comm->gathers;
  ASSERT_TRUE((*ex)->BeginMicrobatch(decision(Decision::kReplicate, Decision::kSkip)).ok());
  ASSERT_TRUE((*ex)->EndForward().ok());
  ASSERT_TRUE((*ex)->BeginMicrobatch(decision(Decision::kReplicate, Decision::kSkip)).ok());
  EXPECT_EQ(comm->gathers, before + 2) << "two units, gathered once";
  EXPECT_TRUE(torch::equal(model->vision_tower->parameters()[0], original[0]));

  const auto& bytes = (*ex)->bytes().at("vision_tower");
  const int64_t full = ((4 * 3 + 3) + (3 * 3 + 3)) * 4;
  EXPECT_EQ(bytes.shard, full);  // A group of one keeps everything.
  EXPECT_EQ(bytes.peak, 2 * full);
  EXPECT_EQ(bytes.resident, 2 * full);
}

struct EncoderImpl : torch::nn::Module {
  torch::nn::ModuleList layers;
  EncoderImpl() {
    layers = register_module("layers", torch::nn::ModuleList(torch::nn::Linear(3, 3), torch::nn::Linear(3, 3)));
  }
};
TORCH_MODULE(Encoder);

// A Hugging Face-like tower: a patch embedding before the layer list and a norm after it.
struct HfTowerImpl : torch::nn::Module {
  torch::nn::Linear patch_embed{nullptr};
  Encoder encoder{nullptr};
  torch::nn::LayerNorm post_layernorm{nullptr};
  HfTowerImpl() {
    patch_embed = register_module("patch_embed", torch::nn::Linear(4, 3));
    encoder = register_module("encoder", Encoder());
    post_layernorm = register_module("post_layernorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})));
    for (auto& p : parameters()) p.set_requires_grad(false);
  }
};
TORCH_MODULE(HfTower);

struct HfModelImpl : torch::nn::Module {
  HfTower vision_tower;
  torch::nn::Linear head{nullptr};
  HfModelImpl() {
    vision_tower = register_module("vision_tower", HfTower());
    head = register_module("head", torch::nn::Linear(3, 2));
  }
};
TORCH_MODULE(HfModel);

TEST(FrozenShardExecutorTest, ARestUnitIsGatheredAroundTheLayersOfItsModule) {
  torch::manual_seed(0);
  HfModel model;
  ManifestOptions options;
  options.layer_list = "encoder.layers";
  auto manifest = *BuildManifest(*model, options);
  ASSERT_EQ(manifest.size(), 1u);
  const int64_t rest_bytes = ((4 * 3 + 3) + (3 + 3)) * 4, layer_bytes = (3 * 3 + 3) * 4;
  ASSERT_EQ(manifest[0].units.size(), 3u);
  EXPECT_EQ(manifest[0].units[0].name, "");  // The rest unit first: patch_embed and post_layernorm.
  EXPECT_EQ(manifest[0].units[0].param_bytes, rest_bytes);
  EXPECT_EQ(manifest[0].units[1].name, "encoder.layers.0");
  EXPECT_EQ(manifest[0].param_bytes, rest_bytes + 2 * layer_bytes);

  std::vector<torch::Tensor> original;
  for (auto& p : model->vision_tower->parameters()) original.push_back(p.detach().clone());
  auto comm = std::make_shared<LoopbackCommunicator>();
  auto ex = FrozenShardExecutor::Create(*model, manifest, comm);
  ASSERT_TRUE(ex.ok()) << ex.status();
  MicrobatchDecision d;
  d.modules = {{"vision_tower", Decision::kPerLayer, DecisionReason::kUniform}};
  ASSERT_TRUE((*ex)->BeginMicrobatch(d).ok());
  const int layer1 = (*ex)->UnitIndex("vision_tower", "encoder.layers.1");
  EXPECT_EQ(layer1, 2);
  // A layer before the module's start would gather in another order than a rank that enters
  // the module first: refused.
  absl::Status early = (*ex)->BeforeUnit("vision_tower", layer1);
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.message(), HasSubstr("call BeginModule"));
  EXPECT_EQ(comm->gathers, 0);

  ASSERT_TRUE((*ex)->BeginModule("vision_tower").ok());
  EXPECT_TRUE(torch::equal(model->vision_tower->patch_embed->weight, original[0]));
  EXPECT_EQ(model->vision_tower->post_layernorm->weight.numel(), 3);
  for (int u : {1, 2}) {
    ASSERT_TRUE((*ex)->BeforeUnit("vision_tower", u).ok());
    ASSERT_TRUE((*ex)->AfterUnit("vision_tower", u).ok());
  }
  ASSERT_TRUE((*ex)->EndModule("vision_tower").ok());
  EXPECT_EQ(model->vision_tower->patch_embed->weight.numel(), 0);
  EXPECT_EQ(comm->gathers, 3);
  const auto& bytes = (*ex)->bytes().at("vision_tower");
  // A group of one keeps every shard; per_layer adds the rest plus one layer at most.
  EXPECT_EQ(bytes.peak, bytes.shard + rest_bytes + layer_bytes);
  ASSERT_TRUE((*ex)->EndForward().ok());

  // root: all three units, the rest first, bitwise the original values.
  d.modules[0].decision = Decision::kRoot;
  ASSERT_TRUE((*ex)->BeginMicrobatch(d).ok());
  auto params = model->vision_tower->parameters();
  ASSERT_EQ(params.size(), original.size());
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], original[i])) << i;
  EXPECT_EQ(comm->gathers, 6);
  ASSERT_TRUE((*ex)->EndForward().ok());

  // A manifest without the rest unit is refused, naming a parameter it leaves out.
  HfModel other;
  auto partial = *BuildManifest(*other, options);
  partial[0].units.erase(partial[0].units.begin());
  auto refused = FrozenShardExecutor::Create(*other, partial, std::make_shared<LoopbackCommunicator>());
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("outside the units its manifest names ('patch_embed.weight'"));
}

// padded: the passes this rank does not make itself are gathered at BeginMicrobatch in the
// order a forward gathers (rest unit, then the layers), one unit at a time; its own call
// gathers as per_layer; the counts are checked.
TEST(FrozenShardExecutorTest, PaddedPassesGatherInForwardOrderAtPerLayersPeak) {
  torch::manual_seed(0);
  HfModel model;
  ManifestOptions options;
  options.layer_list = "encoder.layers";
  auto manifest = *BuildManifest(*model, options);
  const int64_t rest_bytes = ((4 * 3 + 3) + (3 + 3)) * 4, layer_bytes = (3 * 3 + 3) * 4;
  auto comm = std::make_shared<LoopbackCommunicator>();
  auto ex = FrozenShardExecutor::Create(*model, manifest, comm);
  ASSERT_TRUE(ex.ok()) << ex.status();
  MicrobatchDecision d;
  d.key = {4, 1};
  d.modules = {{"vision_tower", Decision::kPadded, DecisionReason::kDivergent, 3}};

  absl::Status missing = (*ex)->BeginMicrobatch(d);
  EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.message(), HasSubstr("'vision_tower' is decided `padded` (3 passes) for (4,1)"));
  absl::Status more = (*ex)->BeginMicrobatch(d, {{"vision_tower", 4}});
  EXPECT_EQ(more.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(more.message(), HasSubstr("planned 4 calls for (4,1) but the group's `padded` decision has 3 passes"));
  EXPECT_EQ(comm->gathers, 0) << "refused before gathering anything";

  ASSERT_TRUE((*ex)->BeginMicrobatch(d, {{"vision_tower", 1}}).ok());
  const size_t rest = (rest_bytes / 4), layer = (layer_bytes / 4);  // Elements (float), a group of one.
  EXPECT_THAT(comm->counts, ::testing::ElementsAre(rest, layer, layer, rest, layer, layer)) << "two passes";
  EXPECT_EQ(model->vision_tower->patch_embed->weight.numel(), 0) << "released after the passes";
  const auto& bytes = (*ex)->bytes().at("vision_tower");
  EXPECT_EQ(bytes.peak, bytes.shard + rest_bytes + layer_bytes) << "per_layer's peak, not the whole tower";
  absl::Status unopened = (*ex)->BeforeUnit("vision_tower", 1);
  EXPECT_EQ(unopened.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(unopened.message(), HasSubstr("runs outside BeginModule/EndModule"));
  EXPECT_EQ(comm->gathers, 6);
  ASSERT_TRUE((*ex)->BeginModule("vision_tower").ok());  // The rank's own call: as per_layer.
  for (int u : {1, 2}) {
    ASSERT_TRUE((*ex)->BeforeUnit("vision_tower", u).ok());
    ASSERT_TRUE((*ex)->AfterUnit("vision_tower", u).ok());
  }
  ASSERT_TRUE((*ex)->EndModule("vision_tower").ok());
  EXPECT_EQ(comm->gathers, 9);
  ASSERT_TRUE((*ex)->EndForward().ok());

  // A rank that runs other than its planned calls no longer gathers with the group: EndForward
  // says so (the rank cannot know earlier which call is its last).
  ASSERT_TRUE((*ex)->BeginMicrobatch(d, {{"vision_tower", 3}}).ok());
  EXPECT_EQ(comm->gathers, 9) << "the busiest rank makes no passes";
  ASSERT_TRUE((*ex)->BeginModule("vision_tower").ok());
  ASSERT_TRUE((*ex)->EndModule("vision_tower").ok());
  absl::Status fewer = (*ex)->EndForward();
  EXPECT_EQ(fewer.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(fewer.message(), HasSubstr("was called 1 times but this rank planned 3"));
  EXPECT_EQ(model->vision_tower->patch_embed->weight.numel(), 0) << "released even so";

  // A forward that failed before EndForward left a unit gathered: the next microbatch releases
  // it first, so its all-gather is issued again like on every other rank.
  d.modules[0] = {"vision_tower", Decision::kPerLayer, DecisionReason::kUniform};
  ASSERT_TRUE((*ex)->BeginMicrobatch(d).ok());
  ASSERT_TRUE((*ex)->BeginModule("vision_tower").ok());  // Gathers the rest unit; then the forward fails.
  const int before = comm->gathers;
  ASSERT_TRUE((*ex)->BeginMicrobatch(d).ok());
  ASSERT_TRUE((*ex)->BeginModule("vision_tower").ok());
  EXPECT_EQ(comm->gathers, before + 1);
}

// Two padded modules: the chain makes the second one's passes only after the rank's own calls of
// the first ended, so a rank that runs the first and pads the second gathers in the order of a
// rank that runs both. Calls out of that order are refused before they gather.
TEST(FrozenShardExecutorTest, PaddedModulesAreAChainInManifestOrder) {
  torch::manual_seed(0);
  Model model;
  auto manifest = *BuildManifest(*model);  // audio_tower (one unit of 6), vision_tower (15 and 12).
  auto comm = std::make_shared<LoopbackCommunicator>();
  auto ex = FrozenShardExecutor::Create(*model, manifest, comm);
  ASSERT_TRUE(ex.ok()) << ex.status();
  MicrobatchDecision d;
  d.key = {0, 0};
  d.modules = {{"audio_tower", Decision::kPadded, DecisionReason::kDivergent, 1},
               {"vision_tower", Decision::kPadded, DecisionReason::kDivergent, 2}};
  ASSERT_TRUE((*ex)->BeginMicrobatch(d, {{"audio_tower", 1}, {"vision_tower", 1}}).ok());
  EXPECT_EQ(comm->gathers, 0) << "the chain waits for this rank's own audio call";
  absl::Status early = (*ex)->BeginModule("vision_tower");
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.message(), HasSubstr("'vision_tower' is called while padded module 'audio_tower' has 1 of its 1"));
  ASSERT_TRUE((*ex)->BeginModule("audio_tower").ok());
  ASSERT_TRUE((*ex)->EndModule("audio_tower").ok());
  EXPECT_THAT(comm->counts, ::testing::ElementsAre(6, 15, 12)) << "audio's call, then vision's one pass";
  ASSERT_TRUE((*ex)->BeginModule("vision_tower").ok());  // Its own call: as per_layer.
  for (int u : {0, 1}) {
    ASSERT_TRUE((*ex)->BeforeUnit("vision_tower", u).ok());
    ASSERT_TRUE((*ex)->AfterUnit("vision_tower", u).ok());
  }
  ASSERT_TRUE((*ex)->EndModule("vision_tower").ok());
  EXPECT_THAT(comm->counts, ::testing::ElementsAre(6, 15, 12, 15, 12));
  absl::Status beyond = (*ex)->BeginModule("audio_tower");
  EXPECT_EQ(beyond.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(beyond.message(), HasSubstr("called more often than the 1 calls this rank planned"));
  EXPECT_EQ(comm->gathers, 5) << "refused before gathering";
  ASSERT_TRUE((*ex)->EndForward().ok());

  // A per_layer module runs after every padded one.
  d.modules = {{"audio_tower", Decision::kPerLayer, DecisionReason::kUniform},
               {"vision_tower", Decision::kPadded, DecisionReason::kDivergent, 1}};
  ASSERT_TRUE((*ex)->BeginMicrobatch(d, {{"vision_tower", 1}}).ok());
  absl::Status before = (*ex)->BeginModule("audio_tower");
  EXPECT_EQ(before.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(before.message(), HasSubstr("while padded module 'vision_tower' has 1 of its 1 planned calls left"));
  EXPECT_EQ(comm->gathers, 5);
}

// A tower with LoRA adapters on a frozen base (as peft makes): base(x) + b(a(x)) per layer, a
// frozen patch embedding and norm around them.
struct AdaptedLayerImpl : torch::nn::Module {
  torch::nn::Linear base{nullptr}, lora_a{nullptr}, lora_b{nullptr};
  AdaptedLayerImpl() {
    base = register_module("base", torch::nn::Linear(3, 3));
    lora_a = register_module("lora_a", torch::nn::Linear(torch::nn::LinearOptions(3, 2).bias(false)));
    lora_b = register_module("lora_b", torch::nn::Linear(torch::nn::LinearOptions(2, 3).bias(false)));
    base->weight.set_requires_grad(false);
    base->bias.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return base(x) + lora_b(lora_a(x)); }
};
TORCH_MODULE(AdaptedLayer);

struct AdaptedTowerImpl : torch::nn::Module {
  torch::nn::Linear patch_embed{nullptr};
  torch::nn::ModuleList layers;
  torch::nn::LayerNorm post_layernorm{nullptr};
  AdaptedTowerImpl() {
    patch_embed = register_module("patch_embed", torch::nn::Linear(4, 3));
    layers = register_module("layers", torch::nn::ModuleList(AdaptedLayer(), AdaptedLayer()));
    post_layernorm = register_module("post_layernorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})));
    for (auto& p : patch_embed->parameters()) p.set_requires_grad(false);
    for (auto& p : post_layernorm->parameters()) p.set_requires_grad(false);
  }
};
TORCH_MODULE(AdaptedTower);

struct AdaptedModelImpl : torch::nn::Module {
  AdaptedTower vision_tower;
  torch::nn::Linear head{nullptr};
  AdaptedModelImpl() {
    vision_tower = register_module("vision_tower", AdaptedTower());
    head = register_module("head", torch::nn::Linear(3, 2));
  }
};
TORCH_MODULE(AdaptedModel);

// One forward and backward of `model` on `x`, through the executor's hooks when there is one.
torch::Tensor AdaptedLoss(AdaptedModel& model, FrozenShardExecutor* ex, const torch::Tensor& x) {
  auto check = [](const absl::Status& s) { EXPECT_TRUE(s.ok()) << s; };
  if (ex) check(ex->BeginModule("vision_tower"));
  torch::Tensor v = model->vision_tower->patch_embed(x);
  for (int i = 0; i < 2; ++i) {
    const int unit = ex ? ex->UnitIndex("vision_tower", "layers." + std::to_string(i)) : 0;
    if (ex) check(ex->BeforeUnit("vision_tower", unit));
    v = torch::gelu(model->vision_tower->layers[i]->as<AdaptedLayer>()->forward(v));
    if (ex) check(ex->AfterUnit("vision_tower", unit, v));
  }
  v = model->vision_tower->post_layernorm(v);
  if (ex) check(ex->EndModule("vision_tower", v));
  return model->head(v).pow(2).mean();
}

TEST(FrozenShardExecutorTest, AdaptersOnAFrozenTowerTrainAsUnshardedUnderEveryDecision) {
  torch::manual_seed(0);
  AdaptedModel model, reference;
  {
    torch::NoGradGuard copy;  // The same weights, and a first adapter that is not zero.
    for (auto& p : model->vision_tower->layers[0]->as<AdaptedLayer>()->lora_b->parameters()) p.normal_();
    for (size_t i = 0; i < model->parameters().size(); ++i) reference->parameters()[i].copy_(model->parameters()[i]);
  }

  // Not opted in: a tower with trainable parameters is left out, as before.
  EXPECT_TRUE(BuildManifest(*model)->empty());
  ManifestOptions unknown;
  unknown.trainable = {"audio_tower"};
  auto refused = BuildManifest(*model, unknown);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("'audio_tower' is no tower or projector of the model"));
  ManifestOptions options;
  options.trainable = {"vision_tower"};
  auto manifest = *BuildManifest(*model, options);
  ASSERT_EQ(manifest.size(), 1u);
  EXPECT_TRUE(manifest[0].trainable);
  ASSERT_EQ(manifest[0].units.size(), 3u);  // The rest unit, then the two layers (adapters counted).
  EXPECT_EQ(manifest[0].units[1].param_bytes, (3 * 3 + 3 + 3 * 2 + 2 * 3) * 4);

  // A spec that is not trainable refuses the adapters, saying how to opt in.
  auto frozen_spec = manifest;
  frozen_spec[0].trainable = false;
  auto not_opted = FrozenShardExecutor::Create(*model, frozen_spec, std::make_shared<LoopbackCommunicator>());
  ASSERT_FALSE(not_opted.ok());
  EXPECT_THAT(not_opted.status().message(), HasSubstr("ManifestOptions::trainable"));
  EXPECT_EQ(model->vision_tower->patch_embed->weight.numel(), 4 * 3) << "a refused manifest leaves the model whole";

  auto comm = std::make_shared<LoopbackCommunicator>();
  auto ex = FrozenShardExecutor::Create(*model, manifest, comm);
  ASSERT_TRUE(ex.ok()) << ex.status();
  auto* layer0 = model->vision_tower->layers[0]->as<AdaptedLayer>();
  EXPECT_EQ(layer0->base->weight.numel(), 0) << "the frozen base is sharded";
  EXPECT_EQ(layer0->lora_a->weight.numel(), 3 * 2) << "the adapters stay whole";

  torch::AutoGradMode grad(true);
  MicrobatchDecision d;
  d.modules = {{"vision_tower", Decision::kPerLayer, DecisionReason::kUniform}};
  for (Decision decision : {Decision::kPerLayer, Decision::kRoot}) {
    SCOPED_TRACE(DecisionName(decision));
    d.modules[0].decision = decision;
    model->zero_grad();
    reference->zero_grad();
    const torch::Tensor x = torch::randn({5, 4});
    const int gathers = comm->gathers;
    ASSERT_TRUE((*ex)->BeginMicrobatch(d).ok());
    torch::Tensor loss = AdaptedLoss(model, ex->get(), x);
    ASSERT_TRUE((*ex)->EndForward().ok());
    // The backward needs the frozen base: kept gathered (every unit gathered once), then released.
    EXPECT_EQ(layer0->base->weight.numel(), 3 * 3);
    EXPECT_EQ(comm->gathers, gathers + 3);
    loss.backward();
    ASSERT_TRUE((*ex)->EndBackward().ok());
    EXPECT_EQ(layer0->base->weight.numel(), 0);
    AdaptedLoss(reference, nullptr, x).backward();
    EXPECT_TRUE(torch::equal(loss, AdaptedLoss(reference, nullptr, x)));
    auto got = model->parameters(), want = reference->parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].grad().defined(), want[i].grad().defined()) << i;
      if (want[i].grad().defined()) {
        EXPECT_TRUE(torch::equal(got[i].grad(), want[i].grad())) << i;
      }
    }
  }
  // Under autograd, per_layer holds the whole tower for the backward, as root does.
  EXPECT_EQ((*ex)->bytes().at("vision_tower").peak, 2 * (*ex)->bytes().at("vision_tower").shard);

  // Without autograd (evaluation), per_layer releases each unit after its forward.
  {
    torch::NoGradGuard eval;
    d.modules[0].decision = Decision::kPerLayer;
    ASSERT_TRUE((*ex)->BeginMicrobatch(d).ok());
    ASSERT_TRUE((*ex)->BeginModule("vision_tower").ok());
    ASSERT_TRUE((*ex)->BeforeUnit("vision_tower", 1).ok());
    EXPECT_EQ(layer0->base->weight.numel(), 3 * 3);
    ASSERT_TRUE((*ex)->AfterUnit("vision_tower", 1, torch::ones({1})).ok());
    EXPECT_EQ(layer0->base->weight.numel(), 0);
  }

  // Under autograd, a unit whose output was given and needs no grad (before the first adapter)
  // is released after its forward, as a frozen one.
  d.modules[0].decision = Decision::kPerLayer;
  ASSERT_TRUE((*ex)->BeginMicrobatch(d).ok());
  ASSERT_TRUE((*ex)->BeginModule("vision_tower").ok());
  ASSERT_TRUE((*ex)->BeforeUnit("vision_tower", 1).ok());
  ASSERT_TRUE((*ex)->AfterUnit("vision_tower", 1, torch::ones({1})).ok());
  EXPECT_EQ(layer0->base->weight.numel(), 0);
  ASSERT_TRUE((*ex)->EndBackward().ok());

  // padded and replicate (an older coordinator's) are refused before anything is gathered.
  for (Decision unsafe : {Decision::kPadded, Decision::kReplicate}) {
    d.modules[0] = {"vision_tower", unsafe, DecisionReason::kDivergent, /*calls=*/1};
    const int gathers = comm->gathers;
    absl::Status s = (*ex)->BeginMicrobatch(d, {{"vision_tower", 1}});
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(s.message(), HasSubstr("trainable module 'vision_tower' is decided `" +
                                       std::string(DecisionName(unsafe)) + "`"));
    EXPECT_EQ(comm->gathers, gathers);
  }
}

// A frozen module whose output needs grad under per_layer: backward would need the weights the
// release drops, so it is refused, naming the unit.
TEST(FrozenShardExecutorTest, AFrozenUnitWhoseOutputNeedsGradIsRefused) {
  HfModel model;
  ManifestOptions options;
  options.layer_list = "encoder.layers";
  auto ex = FrozenShardExecutor::Create(*model, *BuildManifest(*model, options), std::make_shared<LoopbackCommunicator>());
  ASSERT_TRUE(ex.ok()) << ex.status();
  MicrobatchDecision d;
  d.modules = {{"vision_tower", Decision::kPerLayer, DecisionReason::kUniform}};
  ASSERT_TRUE((*ex)->BeginMicrobatch(d).ok());
  ASSERT_TRUE((*ex)->BeginModule("vision_tower").ok());
  ASSERT_TRUE((*ex)->BeforeUnit("vision_tower", 1).ok());
  torch::AutoGradMode grad(true);
  absl::Status s = (*ex)->AfterUnit("vision_tower", 1, torch::ones({2}, torch::requires_grad()));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("unit 'encoder.layers.0' of 'vision_tower' produced an output that requires grad"));
  EXPECT_EQ(model->vision_tower->encoder->layers[0]->as<torch::nn::Linear>()->weight.numel(), 0) << "released";
  // The same under root, where EndForward would release the weights before the backward: the
  // model does not work or fail by the microbatch's decision.
  d.modules[0].decision = Decision::kRoot;
  ASSERT_TRUE((*ex)->BeginMicrobatch(d).ok());
  absl::Status root = (*ex)->EndModule("vision_tower", torch::ones({2}, torch::requires_grad()));
  EXPECT_EQ(root.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(root.message(), HasSubstr("the rest unit of 'vision_tower' produced an output that requires grad"));
}

TEST(FrozenShardExecutorTest, RejectsWhatItCannotShard) {
  Model model;
  auto manifest = *BuildManifest(*model);
  manifest.push_back({"no_such_module", 0, {}, false});
  auto ex = FrozenShardExecutor::Create(*model, manifest, std::make_shared<LoopbackCommunicator>());
  ASSERT_FALSE(ex.ok());
  EXPECT_EQ(ex.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ex.status().message(), HasSubstr("'no_such_module' is not in the model"));
}

}  // namespace
}  // namespace shardcoord::torchx
