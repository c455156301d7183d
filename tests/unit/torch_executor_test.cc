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
    std::memcpy(out, in, count * DataTypeSize(type));
    return absl::OkStatus();
  }
  absl::Status AllReduce(void*, size_t, DataType, ReduceOp) override { return absl::OkStatus(); }
  absl::Status Broadcast(void*, size_t, DataType, int) override { return absl::OkStatus(); }
  absl::Status Barrier() override { return absl::OkStatus(); }
  int gathers = 0;
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
  auto manifest = BuildManifest(*model);
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
  auto with_extra = BuildManifest(*model, extra);
  ASSERT_EQ(with_extra.size(), 3u);
  EXPECT_EQ(with_extra[1].name, "my_adapter");
}

TEST(FrozenShardExecutorTest, MaterializesExactlyAndReleasesPerDecision) {
  torch::manual_seed(0);
  Model model;
  auto manifest = BuildManifest(*model);
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
  auto manifest = BuildManifest(*model, options);
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
  auto partial = BuildManifest(*other, options);
  partial[0].units.erase(partial[0].units.begin());
  auto refused = FrozenShardExecutor::Create(*other, partial, std::make_shared<LoopbackCommunicator>());
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("outside the units its manifest names ('patch_embed.weight'"));
}

TEST(FrozenShardExecutorTest, RejectsWhatItCannotShard) {
  Model model;
  auto manifest = BuildManifest(*model);
  manifest.push_back({"no_such_module", 0, {}, false});
  auto ex = FrozenShardExecutor::Create(*model, manifest, std::make_shared<LoopbackCommunicator>());
  ASSERT_FALSE(ex.ok());
  EXPECT_EQ(ex.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ex.status().message(), HasSubstr("'no_such_module' is not in the model"));
}

}  // namespace
}  // namespace shardcoord::torchx
