"""One rank of the Trainer-integration test (run by test_integrations.py; not a test module).

    trainer_mixin_ranks.py INIT_METHOD RANK WORLD MODE FAMILY STEPS

Debian's torch 1.13 has neither FSDP2 nor ``transformers``, so this drives shardcoord.hf's Trainer
hooks through :class:`FakeTrainer`, a stand-in for the surface of ``transformers.Trainer`` (5.x) that
the hooks use, called in the real Trainer's order (scripts/gpu/hf_trainer_check.py runs the real one
with accelerate's FSDP2 on the GPU machine): ``accelerator.prepare(model)`` before the loop; per update
step ``get_batch_samples(epoch_iterator, num_batches, device)`` returning every microbatch of the step,
then ``training_step(model, inputs, num_items_in_batch)`` per microbatch (forward and backward), then
the gradient all-reduce (DDP's, by hand over Gloo) and the optimizer step; ``prediction_step`` per
evaluation batch. Its accelerator says ``MULTI_CPU``, so the hooks take the plain executor (the
towers sharded over the world, gathered per decision) over real Gloo collectives and a real
shardcoordd.

MODE: ``mixin`` (``class T(shardcoord.hf.TrainerMixin, FakeTrainer)``), ``patch``
(``shardcoord.hf.patch(FakeTrainer(...))``) or ``reference`` (no shardcoord: nothing sharded). The
model is a look-alike of FAMILY (tests/python/hf_lookalikes.py), its towers frozen; each rank draws
its own media per microbatch, so the group agrees on some microbatches and not on others. Prints one
``RESULT {json}`` line: losses (hex floats), the trained parameters' hash, the decisions counted."""

import hashlib
import json
import os
import random
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_lookalikes as hfl  # noqa: E402

import shardcoord.hf  # noqa: E402

ACCUM = 2


class FakeAccelerator:
    """What the hooks read of accelerate's Accelerator."""

    def __init__(self, distributed_type: str = "MULTI_CPU"):
        self.distributed_type = distributed_type
        self.is_fsdp2 = False
        self.prepared = []

    def prepare(self, *objects):
        self.prepared.extend(objects)
        return objects[0] if len(objects) == 1 else list(objects)  # A list, as accelerate 1.15 returns.


class FakeArgs:
    def __init__(self, steps: int):
        self.max_steps = steps
        self.gradient_accumulation_steps = ACCUM


class FakeTrainer:
    """The training loop of transformers.Trainer, reduced to the calls the hooks see (see above)."""

    def __init__(self, model, args, train_dataset, eval_dataset=None, accelerator=None):
        self.model, self.args = model, args
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.accelerator = accelerator or FakeAccelerator()
        self.losses = []

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, sum(int(b["labels"].numel()) for b in batches)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.microbatches_run = getattr(self, "microbatches_run", 0) + 1
        if os.environ.get("STOP_AT_MICROBATCH") == str(self.microbatches_run) and dist.get_rank() == 1:
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)  # Hung with its sockets open, as a stuck GPU would leave it.
        loss = model(**inputs).loss / ACCUM
        loss.backward()
        return loss.detach()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with torch.no_grad():
            return model(**inputs).loss.detach(), None, None

    def train(self):
        model = self.accelerator.prepare(self.model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=0.05)
        epoch_iterator = iter(self.train_dataset)
        for _ in range(self.args.max_steps):
            batches, items = self.get_batch_samples(epoch_iterator, ACCUM, "cpu")
            for inputs in batches:
                self.losses.append(float(self.training_step(model, inputs, items)))
            for p in trainable:  # DDP's gradient all-reduce.
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            optimizer.step()
            optimizer.zero_grad()
        return self.losses

    def evaluate(self):
        return [float(self.prediction_step(self.model, inputs, True)[0]) for inputs in self.eval_dataset]


def data(family: str, rank: int, count: int, seed: int):
    """Per rank, a different draw of the family's kinds (text half of the time)."""
    kinds = [k for k in hfl.KINDS[family] if not k.startswith("empty_") and k not in ("decode_step", "inputs_embeds")]
    rng = random.Random(seed * 100 + rank)
    return [hfl.make_batch(family, "text" if rng.random() < 0.5 else rng.choice(kinds[1:]), seed=seed * 1000 + i)
            for i in range(count)]


def main():
    init, rank, world, mode, family, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
        sys.argv[5], int(sys.argv[6])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = hfl.freeze_towers(hfl.FAMILIES[family](seed=1))
    train, evaluation = data(family, rank, steps * ACCUM, 1), data(family, rank, 2, 2)
    if mode == "mixin":
        class T(shardcoord.hf.TrainerMixin, FakeTrainer):
            pass
        trainer = T(model, FakeArgs(steps), train, evaluation, shardcoord={"timeout": 60.0})
    elif mode == "patch":
        trainer = shardcoord.hf.patch(FakeTrainer(model, FakeArgs(steps), train, evaluation), timeout=60.0)
    else:
        trainer = FakeTrainer(model, FakeArgs(steps), train, evaluation)
    losses = trainer.train()
    eval_losses = [x.hex() for x in trainer.evaluate()]
    trainable = [p for p in model.parameters() if p.requires_grad]
    digest = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in trainable)).hexdigest()[:16]
    result = {"rank": rank, "losses": [x.hex() for x in losses], "params": digest,
              "decisions": dict(getattr(trainer, "shardcoord_decisions", None) or
                                (trainer._shardcoord.decisions if hasattr(trainer, "_shardcoord") else {})),
              "eval": eval_losses}
    print("RESULT " + json.dumps(result), flush=True)
    if hasattr(trainer, "shardcoord_close"):
        trainer.shardcoord_close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
