"""The framework integrations (shardcoord.hf's Trainer hooks, shardcoord.integration, fsdp2's two
phases): a Trainer stand-in (trainer_mixin_ranks.py: the calls transformers.Trainer makes, in its
order) trains a look-alike VLM at two real Gloo ranks under a real shardcoordd, bitwise equal to
the same trainer without shardcoord; the refusals name what to change. The real Trainer with
accelerate's FSDP2 runs on the GPU machine (scripts/gpu/hf_trainer_check.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import shardcoord  # noqa: E402
import shardcoord.hf  # noqa: E402
import shardcoord.torch as sct  # noqa: E402
from shardcoord import integration  # noqa: E402
from trainer_mixin_ranks import FakeAccelerator, FakeArgs, FakeTrainer  # noqa: E402

RUN_DEADLINE = 150  # Seconds for one two-rank run (about 10 normally).


def communicate_all(procs, what):
    """Each process's (stdout, stderr), waiting at most RUN_DEADLINE seconds for each; a hang fails
    the test, and a process still running is killed whatever happens."""
    try:
        return [p.communicate(timeout=RUN_DEADLINE) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: a rank did not finish within {RUN_DEADLINE} s (a collective mismatch hangs)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def run_ranks(tmp_path, mode, family, steps, address=None):
    """Both ranks of one mode; returns their RESULT dicts (rank order), failing the test on a hang."""
    init = f"file://{tmp_path}/store-{mode}"
    env = dict(os.environ, SHARDCOORD_JOB=f"trainer-{mode}-{os.getpid()}")
    if address:
        env["SHARDCOORD_ADDR"] = address
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "trainer_mixin_ranks.py"), init, str(r), "2", mode,
                               family, str(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    results = []
    for p, (out, err) in zip(procs, communicate_all(procs, mode)):
        assert p.returncode == 0, f"{mode} rank failed ({p.returncode}):\n{err[-3000:]}"
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, f"{mode}: no RESULT line:\n{out[-2000:]}\n{err[-2000:]}"
        results.append(json.loads(lines[-1][7:]))
    return results


def test_trainer_hooks_train_like_the_unsharded_trainer(tmp_path, trainer_daemon):
    reference = run_ranks(tmp_path, "reference", "qwen2_5_vl", 4)
    for mode in ("mixin", "patch"):
        got = run_ranks(tmp_path, mode, "qwen2_5_vl", 4, trainer_daemon.address)
        for rank in range(2):
            assert got[rank]["losses"] == reference[rank]["losses"], (mode, rank)  # Bitwise.
            assert got[rank]["eval"] == reference[rank]["eval"], (mode, rank)
            assert got[rank]["params"] == reference[rank]["params"], (mode, rank)
        decisions = got[0]["decisions"]
        # Every microbatch decided (8 trained, 2 evaluated; one controlled module), with the
        # agreeing kinds and the fallback among them (the ranks' media are drawn independently).
        assert sum(decisions.values()) == 10, decisions
        assert decisions.get("per_layer") and decisions.get("root") and decisions.get("skip"), decisions
        assert got[1]["decisions"] == decisions


def test_a_stopped_peer_ends_the_survivor_promptly_naming_it(tmp_path, trainer_daemon):
    """Rank 1 stops (SIGSTOP: its sockets stay open) in its third microbatch; rank 0 is then blocked
    in a Gloo collective with it, which torch 1.13 cannot abort. The coordinator's verdict (after the
    daemon's 5 s heartbeat timeout) must end rank 0 with exit code 3, naming rank 1, not the Gloo
    timeout (30 minutes), and not a hang in the process group's destructor at exit."""
    init = f"file://{tmp_path}/store-stop"
    env = dict(os.environ, SHARDCOORD_JOB=f"trainer-stop-{os.getpid()}", SHARDCOORD_ADDR=trainer_daemon.address,
               STOP_AT_MICROBATCH="3")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "trainer_mixin_ranks.py"), init, str(r), "2", "mixin",
                               "qwen2_5_vl", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=5 + 10 + 30)  # Heartbeat timeout + exit_after + slack.
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 did not end within 45 s of its peer stopping")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    assert procs[0].returncode == 3, err[-3000:]
    assert "rank 1 declared dead" in err, err[-3000:]


# -- refusals and the hooks' seams (no daemon)

class _Vlm(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = nn.Module()
        self.visual.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)


def test_nothing_to_control_names_the_trainable_tower():
    model = _Vlm()
    model.visual.blocks[0].requires_grad_(False)  # Partly frozen: not controlled.
    with pytest.raises(shardcoord.FailedPrecondition,
                       match=r"Seen with trainable parameters: tower 'visual' \(2 of 4 parameters trainable\)"):
        integration.controlled_manifest(model)
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    assert [s.name for s in integration.controlled_manifest(model)] == ["visual"]


def test_unsupported_accelerators_are_refused_with_what_to_set():
    from shardcoord._hf_trainer import _distributed_kind

    with pytest.raises(shardcoord.FailedPrecondition, match=r"DeepSpeed .* use FSDP2"):
        _distributed_kind(FakeAccelerator("DistributedType.DEEPSPEED"))
    with pytest.raises(shardcoord.FailedPrecondition, match=r"FSDP1 is not supported.*fsdp_version': 2"):
        _distributed_kind(FakeAccelerator("FSDP"))
    fsdp2 = FakeAccelerator("FSDP")
    fsdp2.is_fsdp2 = True
    assert _distributed_kind(fsdp2) == "fsdp2"
    assert _distributed_kind(FakeAccelerator("MULTI_GPU")) == "plain"
    trainer = shardcoord.hf.patch(FakeTrainer(_Vlm(), FakeArgs(1), [], accelerator=FakeAccelerator("DEEPSPEED")))
    with pytest.raises(shardcoord.FailedPrecondition, match="DeepSpeed"):
        trainer.train()  # Refused at prepare, before anything is sharded.


def test_options_and_patch_refuse_mistakes():
    with pytest.raises(shardcoord.InvalidArgument, match=r"unknown option\(s\) job; the options are .*job_id"):
        integration.Options.of(job="x")
    trainer = shardcoord.hf.patch(FakeTrainer(_Vlm(), FakeArgs(1), []), job_id="j")
    assert trainer._shardcoord.session.options.job_id == "j"
    with pytest.raises(shardcoord.FailedPrecondition, match="already under shardcoord"):
        shardcoord.hf.patch(trainer)


def test_default_job_id_comes_from_the_launcher(monkeypatch):
    for var in ("SHARDCOORD_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(shardcoord.InvalidArgument, match=r"set \$SHARDCOORD_JOB"):
        integration.default_job_id()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert integration.default_job_id("hf") == "hf-10.0.0.1-29500"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun --standalone: not an id.
    assert integration.default_job_id("hf") == "hf-10.0.0.1-29500"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert integration.default_job_id("hf") == "hf-abc"
    monkeypatch.setenv("SHARDCOORD_JOB", "mine")
    assert integration.default_job_id("hf") == "mine"


class _Worker:
    """A unit seam for Microbatches: records plans, answers every microbatch per_layer."""

    def __init__(self):
        self.reported, self.closed_with = [], "open"
        self.rank, self.closed = 0, False

    def report_plan(self, step, mb, calls):
        self.reported.append((step, mb, dict(calls)))

    def get_decision(self, step, mb, timeout):
        return {"visual": "per_layer"}

    def close(self, timeout=10.0, reason=None):
        self.closed, self.closed_with = True, reason

    def fail(self, error, timeout=10.0):
        self.closed, self.closed_with = True, "failed: " + error


class _Control:
    def __init__(self):
        self.calls = []

    def begin_microbatch(self, decision, calls=None):
        self.calls.append(("begin", dict(calls)))

    def end_microbatch(self):
        self.calls.append(("end",))


def test_microbatches_run_in_plan_order_and_refuse_what_would_diverge():
    worker, control = _Worker(), _Control()
    mbs = integration.Microbatches(worker, control, lambda b: {"visual": b["n"]}, watch=False)
    a, b = {"n": 1}, {"n": 0}
    assert mbs.plan([a, b]) == [(0, 0), (0, 1)]
    assert worker.reported == [(0, 0, {"visual": 1}), (0, 1, {"visual": 0})]
    with pytest.raises(shardcoord.InvalidArgument, match=r"microbatch \(0, 0\) runs another batch"):
        with mbs.run(b):
            pass
    with pytest.raises(shardcoord.FailedPrecondition, match=r"plan\(\) for step 1 while microbatches \[\(0, 0\), "):
        mbs.plan([a])
    for batch in (a, b):
        with mbs.run(batch):
            pass
    assert control.calls == [("begin", {"visual": 1}), ("end",), ("begin", {"visual": 0}), ("end",)]
    with pytest.raises(shardcoord.FailedPrecondition, match=r"run\(\) with no planned microbatch"):
        with mbs.run():
            pass
    # iterate(): a step's batches planned together, each microbatch ended when the next is asked for.
    control.calls.clear()
    seen = [batch["n"] for batch in mbs.iterate([{"n": 2}, {"n": 0}, {"n": 1}], per_step=2)]
    assert seen == [2, 0, 1]
    assert [k for k in worker.reported[2:]] == [(1, 0, {"visual": 2}), (1, 1, {"visual": 0}), (2, 0, {"visual": 1})]
    assert control.calls.count(("end",)) == 3
    assert mbs.decisions == {"per_layer": 5}
    mbs.close(RuntimeError("boom"))
    assert worker.closed_with == "failed: RuntimeError: boom"
    with pytest.raises(shardcoord.FailedPrecondition, match="closed"):
        mbs.plan([a])


def test_a_plan_function_that_raises_reports_nothing():
    worker = _Worker()
    mbs = integration.Microbatches(worker, _Control(), lambda b: {"visual": b["n"]}, watch=False)
    with pytest.raises(KeyError):
        mbs.plan([{"n": 1}, {}])
    assert worker.reported == [] and mbs.pending == []


# -- fsdp2's two phases, over the stand-in FSDP of test_torch.py (torch 1.13 has no FSDP2)

def _two_phase(monkeypatch):
    from shardcoord import fsdp2
    from test_torch import _FakeFsdp, _PaddedVlm

    log, wrapped = [], set()

    def fake_fully_shard(module, **kwargs):
        _FakeFsdp(module, names[id(module)] or "root", log)
        wrapped.add(id(module))

    monkeypatch.setattr(fsdp2, "fully_shard", fake_fully_shard)
    monkeypatch.setattr(fsdp2, "_is_fsdp", lambda module: id(module) in wrapped)
    model = _PaddedVlm()
    names = {id(m): n for n, m in model.named_modules()}
    return fsdp2, model, log, fake_fully_shard


def test_fsdp2_two_phases_leave_the_rest_to_the_framework(monkeypatch):
    fsdp2, model, log, fully_shard = _two_phase(monkeypatch)
    specs = sct.manifest(model)
    towers = fsdp2.shard_towers(model, specs)
    assert towers.modules == ["visual"] and len(towers.controlled["visual"].units) == 3
    with pytest.raises(shardcoord.FailedPrecondition, match=r"attach\(\) needs the model's root wrapped"):
        fsdp2.attach(towers, model)
    fully_shard(model.head)  # The framework's own units, then its root.
    fully_shard(model)
    ctl = fsdp2.attach(towers, model)
    assert fsdp2.attach(towers, model) is ctl  # Idempotent.
    ctl.begin_microbatch({"visual": "per_layer"}, calls={"visual": 1})
    with torch.no_grad():
        model([torch.randn(1, 4)])
    ctl.end_microbatch()
    assert log == ["root", "visual.blocks.0", "visual.blocks.1", "visual.blocks.2", "head"], log
    # A second phase one on the same towers is refused: they are FSDP units already.
    with pytest.raises(shardcoord.FailedPrecondition, match=r"already holds FSDP units \(blocks.0"):
        fsdp2.shard_towers(model, specs)


def test_fsdp2_attach_refuses_a_framework_unit_inside_a_tower(monkeypatch):
    fsdp2, model, log, fully_shard = _two_phase(monkeypatch)
    towers = fsdp2.shard_towers(model, sct.manifest(model))
    fully_shard(model.visual)  # An auto-wrap policy that matched the tower itself.
    fully_shard(model)
    with pytest.raises(shardcoord.FailedPrecondition,
                       match=r"units inside controlled module 'visual' besides its layer units: <itself>.*"
                             r"transformer_cls_names_to_wrap"):
        fsdp2.attach(towers, model)


def test_fsdp2_mesh_shard_group_must_be_the_workers():
    from shardcoord import fsdp2

    class Mesh:
        def __init__(self, grid):
            self.mesh = torch.tensor(grid)

    class Group:
        ranks = [0, 1]

    class Worker:
        rank, group = 0, Group()

    assert fsdp2.mesh_shard_ranks(Mesh([0, 1])) == [0, 1]
    fsdp2.check_shard_group(Worker(), Mesh([0, 1]))
    with pytest.raises(shardcoord.InvalidArgument, match=r"FSDP shards this rank's parameters over ranks \[0, 1, 2, "
                                                         r"3\]: give the Worker group_size=4"):
        fsdp2.check_shard_group(Worker(), Mesh([0, 1, 2, 3]))


# -- the embedded coordinator (no address given: rank 0 starts one for the job)

def test_embedded_coordinator_serves_a_torchrun_job_and_stops_with_it(tmp_path):
    import re
    import socket

    env = {k: v for k, v in os.environ.items() if k not in ("SHARDCOORD_ADDR", "SHARDCOORD_EMBEDDED")}
    env["JOB"] = f"embedded-{os.getpid()}"
    # Debian's torchrun (torch 1.13, Python 3.11) crashes without --redirects/--tee; they work on 2.x too.
    with socket.socket() as s:  # torch 1.13's torchrun takes no port 0: a free one, released just before.
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--redirects", "2", "--tee", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(port), os.path.join(os.path.dirname(HERE), "..", "examples", "python", "minimal_loop.py")]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=RUN_DEADLINE, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the torchrun job did not finish within {RUN_DEADLINE} s")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    hashes = set(re.findall(r"final params hash ([0-9a-f]{16})", out))  # The ranks' lines may interleave.
    assert len(hashes) == 1 and out.count("final params hash") == 2, out[-2000:]
    said = re.search(r"rank 0 started an embedded shardcoordd for this job at 127\.0\.0\.1:(\d+)", out)
    assert said, out[-2000:]
    with socket.socket() as s:  # Stopped with rank 0: nothing listens there any more.
        assert s.connect_ex(("127.0.0.1", int(said.group(1)))) != 0


def test_embedded_coordinator_can_be_refused(monkeypatch):
    from shardcoord import _embedded

    monkeypatch.setenv("SHARDCOORD_EMBEDDED", "0")
    with pytest.raises(shardcoord.InvalidArgument, match=r"set \$SHARDCOORD_ADDR=host:port .*SHARDCOORD_EMBEDDED=0"):
        _embedded.coordinator_for("j", 0, 2)
    monkeypatch.setenv("SHARDCOORD_EMBEDDED", "1")
    for var in ("TORCHELASTIC_USE_AGENT_STORE",):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(shardcoord.InvalidArgument, match=r"no rendezvous store to share an embedded one through: launch "
                                                         r"with torchrun"):
        _embedded.coordinator_for("j", 1, 2)


def test_the_entry_points_run_the_shipped_binaries(monkeypatch, tmp_path):
    from shardcoord import _cli

    assert _cli.binary("shardcoordd"), "the build tree's package has its daemon (shardcoord/_bin)"
    done = subprocess.run([sys.executable, "-c", "import sys; sys.argv[1:] = ['--version']; "
                           "from shardcoord._cli import shardcoordd; shardcoordd()"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and shardcoord.__version__ in done.stdout, done
    monkeypatch.setattr(_cli, "PACKAGE", tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match=r"this installation of shardcoord has no shardctl .*SHARDCOORD_NO_DAEMON"):
        _cli.shardctl()


def test_embedded_coordinator_across_hosts_takes_a_token(tmp_path):
    """Ranks on several hosts (here: LOCAL_WORLD_SIZE 1 per rank, as two one-rank nodes would have):
    rank 0's daemon listens on every interface with a rank token it made, shared through
    torch.distributed's store, and the other rank connects with it."""
    import re
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDCOORD_ADDR", "SHARDCOORD_EMBEDDED", "SHARDCOORD_TOKEN")}
    env.update(JOB=f"hosts-{os.getpid()}", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    script = os.path.join(os.path.dirname(HERE), "..", "examples", "python", "minimal_loop.py")
    procs = [subprocess.Popen([sys.executable, script], env=dict(env, RANK=str(r), LOCAL_RANK="0"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [out for out, _ in communicate_all(procs, "the two-host job")]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "on every interface with a rank token it made, without TLS" in outs[0], outs[0][-2000:]
    hashes = {re.search(r"final params hash ([0-9a-f]{16})", o).group(1) for o in outs}
    assert len(hashes) == 1, outs


def test_manifest_warning_names_a_trainable_tower():
    with pytest.warns(RuntimeWarning, match=r"seen with trainable parameters .*: 'visual'"):
        assert sct.manifest(_Vlm()) == []


class _FsdpBlock(nn.Linear):
    """What fully_shard makes of a block: a subclass named FSDP<class>."""


_FsdpBlock.__name__ = "FSDPLinear"


def test_fsdp2_prepare_resolves_the_wrap_classes_before_the_towers_change_class(monkeypatch):
    """On the GPU machine (transformers 5.17, accelerate 1.15) the first runs failed twice in
    accelerate, which looks the wrap classes up by name after fully_shard had turned
    Qwen2_5_VLVisionBlock into FSDPQwen2_5_VLVisionBlock: in set_auto_wrap_policy, then in
    fsdp2_prepare_auto_wrap_policy. The hook has the plugin resolve them first, and narrows the names
    accelerate looks up again to those the model still has (the sharded blocks are units already)."""
    from types import SimpleNamespace

    order = []

    class Plugin:
        mixed_precision_policy = cpu_offload = None
        transformer_cls_names_to_wrap = None

        def set_auto_wrap_policy(self, model):
            order.append("resolve")
            self.transformer_cls_names_to_wrap = ["Linear", "ModuleList"]  # From _no_split_modules.

    def shard_towers(self, model, *args, **kwargs):
        order.append("shard towers")
        for block in model.visual.blocks:
            block.__class__ = _FsdpBlock
        model.head.__class__ = _FsdpBlock  # No Linear is left: only ModuleList is looked up again.

    plugin = Plugin()
    accelerator = FakeAccelerator("FSDP")
    accelerator.is_fsdp2 = True
    accelerator.state = SimpleNamespace(fsdp_plugin=plugin)
    accelerator.torch_device_mesh = accelerator.parallelism_config = None
    monkeypatch.setattr(integration.Session, "shard_towers", shard_towers)
    monkeypatch.setattr(integration.Session, "attach", lambda self, root: order.append(("attach", root)))
    trainer = shardcoord.hf.patch(FakeTrainer(_Vlm(), FakeArgs(1), [], accelerator=accelerator))
    model, optimizer = trainer.accelerator.prepare(trainer.model, "optimizer")  # As the Trainer calls it.
    assert order == ["resolve", "shard towers", ("attach", model)], "attached to the model, not the list"
    assert plugin.transformer_cls_names_to_wrap == ["ModuleList"]


def test_wrap_classes_inside_the_towers_units_are_left_to_them_and_a_shared_class_is_refused(monkeypatch):
    """Qwen2-Audio's _no_split_modules names Qwen2AudioAttention, a module inside each encoder layer:
    on the GPU machine accelerate fully_shard-ed those inside the towers' units (torch: "value was
    None"). The names accelerate looks up again keep only classes with modules outside the units."""
    from types import SimpleNamespace

    from shardcoord import fsdp2
    from shardcoord._hf_trainer import narrow_wrap_names

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)

    class EncoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention()

    class DecoderLayer(nn.Module):
        def __init__(self, shared: bool):
            super().__init__()
            self.mlp = Attention() if shared else nn.Linear(2, 2)

    def model(shared: bool):
        m = nn.Module()
        m.audio_tower = nn.Module()
        m.audio_tower.layers = nn.ModuleList([EncoderLayer(), EncoderLayer()])
        m.decoder = nn.ModuleList([DecoderLayer(shared), DecoderLayer(shared)])
        return m

    plugin = SimpleNamespace(transformer_cls_names_to_wrap=["Attention", "DecoderLayer"])
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    vlm = model(shared=False)
    units = {id(layer) for layer in vlm.audio_tower.layers}  # What shard_towers made FSDP units.
    monkeypatch.setattr(fsdp2, "_is_fsdp", lambda module: id(module) in units)
    narrow_wrap_names(accelerator, vlm)
    assert plugin.transformer_cls_names_to_wrap == ["DecoderLayer"]

    plugin.transformer_cls_names_to_wrap = ["Attention"]  # Only classes inside the towers: nothing else wrapped.
    with pytest.raises(shardcoord.FailedPrecondition, match=r"every FSDP2 wrap class .* is inside the controlled towers"):
        narrow_wrap_names(accelerator, vlm)

    plugin.transformer_cls_names_to_wrap = ["Attention", "DecoderLayer"]
    vlm = model(shared=True)
    units = {id(layer) for layer in vlm.audio_tower.layers}
    with pytest.raises(shardcoord.FailedPrecondition, match=r"\['Attention'\] have modules inside the controlled "
                                                            r"towers and outside them.*transformer_layer_cls_to_wrap"):
        narrow_wrap_names(accelerator, vlm)


def test_the_towers_units_are_left_out_of_fsdps_forward_record():
    """On the GPU machine the HF runs hung at the first backward: FSDP2 records each unit's forward
    and prefetches, in backward, the unit recorded before; a tower's units are recorded on the ranks
    that ran it only. shard_towers leaves them out of the record (FSDPParamGroup._record_post_forward)."""
    from types import SimpleNamespace

    from shardcoord import fsdp2

    order = []

    class Group:
        def _record_post_forward(self):
            order.append(self)

    group = Group()
    unit = nn.Linear(2, 2)
    unit._get_fsdp_state = lambda: SimpleNamespace(_fsdp_param_group=group)
    fsdp2._keep_out_of_backward_order(unit)
    group._record_post_forward()  # What FSDP2's post_forward calls.
    assert order == [], "a tower unit's forward is not recorded"
    other = Group()
    other._record_post_forward()
    assert order == [other], "other units are"


def test_patch_keeps_the_trainers_class_and_gives_live_decision_counts():
    """patch() swapped the trainer's class to add shardcoord_decisions, which broke pickling and
    `type(trainer) is X`; the counts are now a live mapping on the instance."""
    trainer = FakeTrainer(_Vlm(), FakeArgs(1), [], accelerator=FakeAccelerator("NO"))
    cls = type(trainer)
    shardcoord.hf.patch(trainer)
    assert type(trainer) is cls
    assert dict(trainer.shardcoord_decisions) == {}, "nothing decided before training"
    trainer._shardcoord.session.microbatches = type("M", (), {"decisions": {"per_layer": 2}})()
    assert dict(trainer.shardcoord_decisions) == {"per_layer": 2}, "read live"


def test_a_trainable_towers_parameters_sit_out_the_frameworks_optimizer_switch():
    """Phase one replaces a trainable tower's layer parameters (fully_shard); accelerate's prepare then
    maps only the parameters it finds in the model. They are held out of the optimizer across it and
    put back, as the prepared model's, where they were."""
    from shardcoord._hf_trainer import OptimizerHold

    model = _Vlm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = list(model.parameters())
    hold = OptimizerHold(model, ("not an optimizer", opt))
    block = model.visual.blocks[0]
    block.weight = nn.Parameter(block.weight.detach().clone())  # What fully_shard does to a unit.
    hold.take()
    assert all(p is not first[0] for p in opt.param_groups[0]["params"])
    assert len(opt.param_groups[0]["params"]) == len(first) - 1
    hold.put_back(model)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in [block.weight] + first[1:]]
