// vlm_trainer: a small vision-language model trained data-parallel on CPU (Gloo), whose
// frozen vision tower and projector are sharded by shardcoord's executor and placed, per
// microbatch, by the coordinator's decisions.
//
//   vlm_trainer --coordinator ADDR --job J --rank R --world-size W --group-size G
//               [--policy auto|per_layer|root|replicate] [--fallback root|replicate|padded]
//               [--media mixed|all|none|rank0] [--image-fraction F] [--skew S]
//               [--steps N] [--accum K] [--tower-adapters R] [--no-shard]
//
// Model: vision_tower (frozen; a layer list of Linear+GELU), multi_modal_projector (frozen),
// text_embed, text_layers and head (trainable). --tower-adapters R puts LoRA adapters of rank R
// on the tower's layers (trainable; the tower is opted in as a trainable module, so only its
// frozen base is sharded, and it runs under autograd) and trains the projector (left to the
// trainer, as LLaVA recipes do). Every rank starts from the same weights
// (same seed). Each step runs K accumulated microbatches; the data loader knows which carry
// images and reports plans `--lookahead` microbatches ahead; gradients of the trainable part
// are averaged over the world with an all-reduce; plain SGD.
//
// Prints one line per step with the loss in hex float (bitwise comparable), then the hash of
// the trainable parameters and a summary. --no-shard runs the same training without the
// executor (frozen parameters whole on every rank): the reference for bitwise equality.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "shardcoord/torch/executor.h"
#include "shardcoord/plan_ahead.h"
#include "shardcoord/worker.h"

namespace {

constexpr int kImageIn = 16, kPatches = 4, kVisionDim = 32, kVisionLayers = 3;
constexpr int kTextIn = 12, kHidden = 24, kClasses = 5, kBatch = 4;

// Laid out like a Hugging Face tower: a patch embedding before the layer list and a norm after
// it, both outside the list (the manifest's rest unit ""), then the layers.
// One layer of the tower: a Linear, and with adapters (rank > 0) a LoRA pair beside it, as peft
// makes: base(x) + b(a(x)), b starting at zero.
struct VisionLayerImpl : torch::nn::Module {
  torch::nn::Linear base{nullptr}, lora_a{nullptr}, lora_b{nullptr};
  explicit VisionLayerImpl(int rank) {
    base = register_module("base", torch::nn::Linear(kVisionDim, kVisionDim));
    if (rank == 0) return;
    lora_a = register_module("lora_a", torch::nn::Linear(torch::nn::LinearOptions(kVisionDim, rank).bias(false)));
    lora_b = register_module("lora_b", torch::nn::Linear(torch::nn::LinearOptions(rank, kVisionDim).bias(false)));
    torch::NoGradGuard init;
    lora_b->weight.zero_();
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = base(x);
    return lora_a ? y + lora_b(lora_a(x)) : y;
  }
};
TORCH_MODULE(VisionLayer);

struct VisionTowerImpl : torch::nn::Module {
  torch::nn::Linear patch_embed{nullptr};
  torch::nn::ModuleList layers;
  torch::nn::LayerNorm post_layernorm{nullptr};
  explicit VisionTowerImpl(int adapter_rank) {
    patch_embed = register_module("patch_embed", torch::nn::Linear(kImageIn, kVisionDim));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < kVisionLayers; ++i) layers->push_back(VisionLayer(adapter_rank));
    post_layernorm = register_module("post_layernorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kVisionDim})));
  }
};
TORCH_MODULE(VisionTower);

struct VlmImpl : torch::nn::Module {
  VisionTower vision_tower{nullptr};
  torch::nn::Linear multi_modal_projector{nullptr}, text_embed{nullptr}, head{nullptr};
  torch::nn::ModuleList text_layers;
  explicit VlmImpl(int adapter_rank) {
    vision_tower = register_module("vision_tower", VisionTower(adapter_rank));
    multi_modal_projector = register_module("multi_modal_projector", torch::nn::Linear(kVisionDim, kHidden));
    text_embed = register_module("text_embed", torch::nn::Linear(kTextIn, kHidden));
    text_layers = register_module("text_layers", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) text_layers->push_back(torch::nn::Linear(kHidden, kHidden));
    head = register_module("head", torch::nn::Linear(kHidden, kClasses));
    for (auto& item : vision_tower->named_parameters()) {  // The base frozen; adapters train.
      if (item.key().find(".lora_") == std::string::npos) item.value().set_requires_grad(false);
    }
    if (adapter_rank > 0) return;  // With adapters the projector trains too.
    for (auto& p : multi_modal_projector->parameters()) p.set_requires_grad(false);
  }
};
TORCH_MODULE(Vlm);

struct Microbatch {
  bool images = false;
  torch::Tensor image, text, target;
};

// Deterministic data: which ranks have images, and the tensors, from (seed, rank, step, mb).
bool HasImages(const std::string& media, double fraction, double skew, int seed, int rank, int step, int mb) {
  if (media == "all") return true;
  if (media == "none") return false;
  if (media == "rank0") return rank == 0;
  uint64_t h = 1469598103934665603ULL;
  for (int64_t v : {int64_t{seed}, int64_t{rank}, int64_t{step}, int64_t{mb}}) {
    h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ULL;
    h *= 1099511628211ULL;
  }
  const double p = std::clamp(fraction + (rank % 2 == 0 ? skew : -skew), 0.0, 1.0);
  return static_cast<double>(h % 10000) / 10000.0 < p;
}

Microbatch MakeMicrobatch(bool images, int seed, int rank, int step, int mb) {
  torch::manual_seed(seed * 1000003 + rank * 10007 + step * 101 + mb);
  Microbatch m;
  m.images = images;
  m.text = torch::randn({kBatch, kTextIn});
  m.image = torch::randn({kBatch, kPatches, kImageIn});
  m.target = torch::randint(0, kClasses, {kBatch}, torch::kLong);
  return m;
}

uint64_t HashParams(Vlm& model) {
  uint64_t h = 1469598103934665603ULL;
  for (const auto& p : model->parameters()) {
    if (!p.requires_grad()) continue;
    torch::Tensor c = p.detach().to(torch::kCPU).contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    for (int64_t i = 0; i < c.numel() * static_cast<int64_t>(c.element_size()); ++i) {
      h ^= bytes[i];
      h *= 1099511628211ULL;
    }
  }
  return h;
}

shardcoord::Worker* g_worker = nullptr;  // Once connected: Fail says goodbye with the cause.

void Fail(const std::string& what, const absl::Status& s) {
  std::cerr << "vlm_trainer: " << what << ": " << s << "\n";
  // A clean leave naming the cause: the ranks left behind then name it too, instead of
  // "rank N declared dead: session stream lost" for every rank that stops after the first.
  if (g_worker != nullptr) g_worker->Close(absl::StrCat("vlm_trainer stopped: ", what, ": ", s.ToString()), absl::Seconds(2));
  std::exit(3);
}

// The command line.
struct TrainerOptions {
  std::string address, job = "vlm", policy = "auto", fallback = "root", media = "mixed";
  int rank = 0, world = 2, group_size = 2, steps = 5, accum = 2, lookahead = 4, seed = 7, adapter_rank = 0;
  double image_fraction = 0.5, skew = 0.0, lr = 0.05;
  bool no_shard = false;
  int interval_ms = 0;
  std::string device_name = "cpu";
  int64_t memory_budget = 0;
  int reconnect_window_ms = static_cast<int>(absl::ToInt64Milliseconds(shardcoord::kDefaultReconnectWindow));
};

void AddFlags(CLI::App& app, TrainerOptions* o) {
  app.add_option("--coordinator", o->address, "shardcoordd HOST:PORT (default $SHARDCOORD_ADDR)")->envname("SHARDCOORD_ADDR");
  app.add_option("--job", o->job);
  app.add_option("--rank", o->rank)->required();
  app.add_option("--world-size", o->world);
  app.add_option("--group-size", o->group_size);
  app.add_option("--policy", o->policy)->check(CLI::IsMember(shardcoord::PolicyNames()));
  app.add_option("--fallback", o->fallback)->check(CLI::IsMember(shardcoord::FallbackNames()));
  app.add_option("--media", o->media)->check(CLI::IsMember({"mixed", "all", "none", "rank0"}));
  app.add_option("--image-fraction", o->image_fraction);
  app.add_option("--skew", o->skew, "even ranks get fraction + skew, odd ranks fraction - skew");
  app.add_option("--steps", o->steps);
  app.add_option("--accum", o->accum, "microbatches accumulated per optimizer step");
  app.add_option("--lookahead", o->lookahead);
  app.add_option("--seed", o->seed);
  app.add_option("--lr", o->lr);
  app.add_option("--memory-budget-bytes", o->memory_budget,
                 "memory this rank can spare for replicating frozen modules (enables `auto` promotion)");
  app.add_option("--device", o->device_name, "cpu (Gloo) or cuda (NCCL; GPU rank % device count)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--interval-ms", o->interval_ms, "pause after each step (demos: to watch live status)");
  app.add_option("--tower-adapters", o->adapter_rank,
                 "LoRA adapters of this rank on the tower's layers, trained (0: none, the tower frozen)")
      ->check(CLI::Range(0, kVisionDim));
  app.add_flag("--no-shard", o->no_shard, "reference run: frozen parameters whole on every rank");
  app.add_option("--reconnect-window-ms", o->reconnect_window_ms,
                 "after losing the coordinator, how long to reconnect and resume before failing (0: fail at once)");
}

// The worker, its communicators and the executor, once connected.
struct Session {
  std::unique_ptr<shardcoord::Worker> worker;
  std::shared_ptr<shardcoord::Communicator> world_comm;
  std::unique_ptr<shardcoord::torchx::FrozenShardExecutor> exec;  // Null with --no-shard.
};

shardcoord::WorkerOptions WorkerOptionsFor(const TrainerOptions& o, const std::vector<shardcoord::ModuleSpec>& manifest) {
  shardcoord::WorkerOptions wo;
  wo.coordinator_address = o.address;
  wo.job_id = o.job;
  wo.rank = o.rank;
  wo.world_size = o.world;
  wo.group_size = o.group_size;
  wo.modules = manifest;
  wo.policy = *shardcoord::ParsePolicy(o.policy);
  wo.fallback = *shardcoord::ParseFallback(o.fallback);
  wo.lookahead = o.lookahead;
  wo.memory_budget_bytes = o.memory_budget;
  wo.connect_timeout = absl::Seconds(30);
  wo.reconnect_window = absl::Milliseconds(o.reconnect_window_ms);
  return wo;
}

// Registers, opens the world communicator and (unless --no-shard) the group's and the
// executor over it. Exits (Fail) on any error.
Session Connect(const TrainerOptions& o, Vlm& model, const std::vector<shardcoord::ModuleSpec>& manifest, bool cuda,
                int gpu) {
  Session session;
  auto worker = shardcoord::Worker::Connect(WorkerOptionsFor(o, manifest));
  if (!worker.ok()) Fail("connect", worker.status());
  session.worker = std::move(*worker);
  g_worker = session.worker.get();
  shardcoord::CommunicatorOptions world_opts;
  world_opts.name = "world";
  if (cuda) {
    world_opts.backend = shardcoord::Backend::kNccl;
    world_opts.cuda_device = gpu;
  }
  auto world_comm = session.worker->OpenCommunicator(world_opts);
  if (!world_comm.ok()) Fail("world communicator", world_comm.status());
  session.world_comm = *world_comm;
  if (o.no_shard) return session;
  shardcoord::CommunicatorOptions group_opts;
  group_opts.name = "group";
  group_opts.backend = world_opts.backend;
  group_opts.cuda_device = gpu;
  auto group_comm = session.worker->OpenCommunicator(group_opts);
  if (!group_comm.ok()) Fail("group communicator", group_comm.status());
  auto e = shardcoord::torchx::FrozenShardExecutor::Create(*model, manifest, *group_comm);
  if (!e.ok()) Fail("executor", e.status());
  session.exec = std::move(*e);
  return session;
}

// Fails with `what` unless `s` is ok.
void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Fail(what, s);
}

// The image features: the vision tower (its rest unit, patch embedding and norm, around the
// layers), then the projector, each gathered and released by the executor where it controls
// them. A frozen tower runs without autograd (frozen modules need no backward collectives); one
// with adapters under it, and the executor keeps its frozen base gathered for the backward
// (EndBackward releases it). The sum with x is made with autograd on, so the trainable layers
// before it still learn from microbatches with images.
torch::Tensor AddImageFeatures(Vlm& model, shardcoord::torchx::FrozenShardExecutor* exec, const torch::Tensor& image,
                               const torch::Tensor& x, bool adapters) {
  torch::Tensor v;
  {
    torch::AutoGradMode grad(adapters);
    if (exec) Check(exec->BeginModule("vision_tower"), "gather");
    v = model->vision_tower->patch_embed(image);
    for (int u = 0; u < kVisionLayers; ++u) {
      const int unit = exec ? exec->UnitIndex("vision_tower", "layers." + std::to_string(u)) : u;
      if (exec) Check(exec->BeforeUnit("vision_tower", unit), "gather");
      v = torch::gelu(model->vision_tower->layers[u]->as<VisionLayer>()->forward(v));
      if (exec) Check(exec->AfterUnit("vision_tower", unit, v), "release");
    }
    v = model->vision_tower->post_layernorm(v);
    if (exec) Check(exec->EndModule("vision_tower", v), "release");
  }
  if (adapters) return x + model->multi_modal_projector(v.mean(1));  // Trained, not controlled.
  torch::Tensor p;
  {
    torch::NoGradGuard frozen;
    if (exec) Check(exec->BeginModule("multi_modal_projector"), "gather");
    p = model->multi_modal_projector(v.mean(1));
    if (exec) Check(exec->EndModule("multi_modal_projector", p), "release");
  }
  return x + p;
}

// The training loop's state across steps.
struct Trainer {
  Trainer(const TrainerOptions& options, Vlm& vlm, Session& s, torch::Device d)
      : o(options), model(vlm), session(s), device(d) {
    for (auto& p : model->parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
  }

  const TrainerOptions& o;
  Vlm& model;
  Session& session;
  torch::Device device;
  std::vector<torch::Tensor> trainable;
  std::vector<std::string> controlled;  // The manifest's modules, planned every microbatch.
  std::map<std::string, int64_t> decided;
  int64_t fallbacks = 0;

  bool HasImagesAt(int i) const {
    return HasImages(o.media, o.image_fraction, o.skew, o.seed, o.rank, i / o.accum, i % o.accum);
  }
};

// One microbatch under its decision: forward and backward; returns its (scaled) loss.
// `calls`: the plan this rank reported for the microbatch (PlanAhead::plan()).
double RunMicrobatch(Trainer& t, const shardcoord::MicrobatchDecision& d, const std::map<std::string, int32_t>& calls,
                     int step, int mb) {
  for (const auto& m : d.modules) {
    t.decided[shardcoord::DecisionName(m.decision)]++;
    if (m.reason == shardcoord::DecisionReason::kDivergent) t.fallbacks++;
  }
  shardcoord::torchx::FrozenShardExecutor* exec = t.session.exec.get();
  Microbatch batch = MakeMicrobatch(t.HasImagesAt(step * t.o.accum + mb), t.o.seed, t.o.rank, step, mb);
  batch.text = batch.text.to(t.device);
  batch.image = batch.image.to(t.device);
  batch.target = batch.target.to(t.device);
  // This rank's planned calls (what PlanAhead reported): a padded module pads up to the group's.
  if (exec) Check(exec->BeginMicrobatch(d, calls), "begin microbatch");
  torch::Tensor x = torch::relu(t.model->text_embed(batch.text));
  if (batch.images) x = AddImageFeatures(t.model, exec, batch.image, x, t.o.adapter_rank > 0);
  for (const auto& layer : *t.model->text_layers) x = torch::relu(layer->as<torch::nn::Linear>()->forward(x));
  torch::Tensor loss = torch::nn::functional::cross_entropy(t.model->head(x), batch.target) / t.o.accum;
  if (exec) Check(exec->EndForward(), "end forward");
  loss.backward();
  if (exec) Check(exec->EndBackward(), "end backward");
  return loss.item<double>();
}

// Data parallel: averages the trainable gradients over the world, then one SGD step.
void AverageAndStep(Trainer& t) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (auto& p : t.trainable) {
    grads.push_back(p.grad().defined() ? p.grad().reshape({-1}) : torch::zeros({p.numel()}, p.options()));
  }
  torch::Tensor flat = torch::cat(grads).contiguous();
  Check(t.session.world_comm->AllReduce(flat.data_ptr<float>(), flat.numel()), "all-reduce");
  flat.div_(t.o.world);
  int64_t off = 0;
  for (auto& p : t.trainable) {
    p.sub_(flat.narrow(0, off, p.numel()).view(p.sizes()) * t.o.lr);
    off += p.numel();
  }
}

// Every step: the accumulated microbatches, each under the decision PlanAhead fetched.
void Train(Trainer& t) {
  const TrainerOptions& o = t.o;
  shardcoord::PlanAhead ahead(*t.session.worker, o.steps * o.accum, [&](int64_t i) {
    const int calls = t.HasImagesAt(static_cast<int>(i)) ? 1 : 0;
    shardcoord::MicrobatchPlan plan{shardcoord::MicrobatchKey{i / o.accum, static_cast<int32_t>(i % o.accum)}, {}};
    for (const auto& module : t.controlled) plan.calls[module] = calls;
    return plan;
  }, o.lookahead);
  for (int step = 0; step < o.steps; ++step) {
    for (auto& p : t.trainable) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    double step_loss = 0;
    for (int mb = 0; mb < o.accum; ++mb) {
      auto d = ahead.Next(absl::Seconds(60));
      if (!d.ok()) Fail("decision", d.status());
      step_loss += RunMicrobatch(t, *d, ahead.plan().calls, step, mb);
    }
    AverageAndStep(t);
    if (t.session.exec) t.session.worker->ReportMemory(t.session.exec->MemoryUsage());  // Shown by `shardctl ranks`.
    std::printf("step %d loss %a (%.6f)\n", step, step_loss, step_loss);
    std::fflush(stdout);
    if (o.interval_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.interval_ms));
  }
}

void PrintSummary(Trainer& t) {
  std::printf("final params hash %016" PRIx64 "\n", HashParams(t.model));
  std::printf("summary rank %d: decisions per_layer=%" PRId64 " skip=%" PRId64 " root=%" PRId64 " replicate=%" PRId64
              " padded=%" PRId64 " fallbacks=%" PRId64,
              t.o.rank, t.decided["per_layer"], t.decided["skip"], t.decided["root"], t.decided["replicate"],
              t.decided["padded"], t.fallbacks);
  if (const auto& exec = t.session.exec) {
    int64_t gathered = 0;
    for (const auto& [name, b] : exec->bytes()) gathered += b.gathered;
    std::printf(" gathered_bytes=%" PRId64 " peak_frozen_bytes=%" PRId64, gathered, exec->peak_total_bytes());
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"vlm_trainer: frozen-tower VLM trained under shardcoord"};
  TrainerOptions o;
  AddFlags(app, &o);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);  // Deterministic, and 2 cores are shared by all ranks.

  const bool cuda = o.device_name == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::cerr << "vlm_trainer: --device cuda but no CUDA device is visible\n";
    return 3;
  }
  const int gpu = cuda ? o.rank % static_cast<int>(torch::cuda::device_count()) : 0;
  const torch::Device device = cuda ? torch::Device(torch::kCUDA, gpu) : torch::Device(torch::kCPU);
  torch::manual_seed(1234);  // Identical initial weights on every rank.
  Vlm model(o.adapter_rank);
  model->to(device);
  // In the order the forward calls the modules (the tower, then the projector), which is the
  // order a padded decision's gather-only passes follow. With adapters the tower is controlled
  // as a trainable module, and the trained projector is not controlled.
  shardcoord::torchx::ManifestOptions manifest_options;
  if (o.adapter_rank > 0) manifest_options.trainable = {"vision_tower"};
  auto built = shardcoord::torchx::BuildManifest(*model, manifest_options);
  if (!built.ok()) Fail("manifest", built.status());
  std::vector<shardcoord::ModuleSpec> manifest = *std::move(built);
  std::stable_sort(manifest.begin(), manifest.end(), [](const auto& a, const auto& b) {
    return a.name == "vision_tower" && b.name != "vision_tower";
  });
  Session session = Connect(o, model, manifest, cuda, gpu);
  Trainer trainer(o, model, session, device);
  for (const auto& spec : manifest) trainer.controlled.push_back(spec.name);
  Train(trainer);
  PrintSummary(trainer);
  session.worker->Close();
  return 0;
}
