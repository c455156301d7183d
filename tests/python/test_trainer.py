"""The seed's two-rank regression with the Python example trainer (examples/python/vlm_train.py):
real rank processes (torch, Gloo on CPU) under a real shardcoordd, every policy. Mirrors
tests/multiprocess/trainer_test.cc. Every wait has a deadline; every process is killed in a
finally."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLM_TRAIN = ROOT / "examples" / "python" / "vlm_train.py"
EXECUTOR_RANKS = Path(__file__).resolve().parent / "executor_ranks.py"
PADDED_RANKS = Path(__file__).resolve().parent / "padded_ranks.py"
ADAPTER_RANKS = Path(__file__).resolve().parent / "adapter_ranks.py"
RUN_DEADLINE = 120  # Seconds for one training run (a few seconds normally).
_jobs = itertools.count()


@dataclass
class RankResult:
    exit_code: int  # -1: it hung (killed at the deadline).
    losses: List[str] = field(default_factory=list)  # Hex floats, bitwise comparable.
    params_hash: str = ""
    summary: str = ""
    err: str = ""


def start(tmp_path, name, argv, env=None):
    out = open(tmp_path / f"{name}.out", "w")
    err = open(tmp_path / f"{name}.err", "w")
    try:
        return subprocess.Popen(argv, stdout=out, stderr=err, env={**os.environ, **(env or {})})
    finally:
        out.close()
        err.close()


def stop_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def wait_code(proc, deadline) -> int:
    try:
        return proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return -1


def rank_argv(daemon, tmp_path, job, rank, world, group, extra):
    return [sys.executable, str(VLM_TRAIN), "--coordinator", daemon.address, "--job", job, "--rank", str(rank),
            "--world-size", str(world), "--group-size", str(group), "--init-method", f"file://{tmp_path}/{job}.store",
            *extra]


def train(daemon, tmp_path, policy, media, *extra, world=2, group=2) -> List[RankResult]:
    """Runs a job of `world` ranks (3 steps of 2 microbatches) and returns what each rank printed."""
    job = f"job{next(_jobs)}"
    procs = []
    try:
        for r in range(world):
            argv = rank_argv(daemon, tmp_path, job, r, world, group,
                             ["--policy", policy, "--media", media, "--steps", "3", "--accum", "2", *extra])
            procs.append(start(tmp_path, f"{job}-{r}", argv, {"SHARDCOORD_LOG_LEVEL": "warn"}))
        deadline = time.monotonic() + RUN_DEADLINE
        codes = [wait_code(p, deadline) for p in procs]
    finally:
        stop_all(procs)
    results = []
    for r, code in enumerate(codes):
        res = RankResult(code, err=(tmp_path / f"{job}-{r}.err").read_text())
        for line in (tmp_path / f"{job}-{r}.out").read_text().splitlines():
            f = line.split()
            if len(f) >= 4 and f[0] == "step" and f[2] == "loss":
                res.losses.append(f[3])
            elif len(f) == 4 and f[0] == "final":
                res.params_hash = f[3]
            elif line.startswith("summary"):
                res.summary = line
        results.append(res)
    return results


def expect_healthy(run: List[RankResult]):
    for r, res in enumerate(run):
        assert res.exit_code == 0, f"rank {r} exited {res.exit_code}: {res.err}"
        assert len(res.losses) == 3, res.losses
        for loss in res.losses:
            assert float.fromhex(loss) == float.fromhex(loss) and abs(float.fromhex(loss)) < float("inf"), loss
        assert res.params_hash == run[0].params_hash, "ranks disagree on the trained parameters"


def two_ranks(tmp_path, name: str, script: Path, seconds: float, args: Sequence[str] = ()) -> List[str]:
    """Runs ``script INIT_METHOD RANK 2 ARGS...`` as two Gloo ranks (a deadline of ``seconds``);
    asserts both exit 0 and returns each rank's output."""
    procs = []
    try:
        for r in range(2):
            procs.append(start(tmp_path, f"{name}-{r}", [sys.executable, str(script),
                                                         f"file://{tmp_path}/{name}.store", str(r), "2", *args]))
        deadline = time.monotonic() + seconds
        codes = [wait_code(p, deadline) for p in procs]
    finally:
        stop_all(procs)
    outs = []
    for r in range(2):
        out, err = (tmp_path / f"{name}-{r}.out").read_text(), (tmp_path / f"{name}-{r}.err").read_text()
        assert codes[r] == 0, f"rank {r} exited {codes[r]} (-1: hung): {err}"
        outs.append(out)
    return outs


def result_of(out: str) -> dict:
    """The ``result JSON`` line a rank program prints."""
    return json.loads(next(l for l in out.splitlines() if l.startswith("result "))[len("result "):])


def test_executor_two_ranks_gathers_bitwise(tmp_path):
    for r, out in enumerate(two_ranks(tmp_path, "exec", EXECUTOR_RANKS, 60)):
        assert f"ok rank {r} gathered 608 peak 228" in out


def test_a_tower_with_adapters_on_a_frozen_base_trains_like_the_unsharded_model(tmp_path):
    """tests/python/adapter_ranks.py: two Gloo ranks, a tower whose frozen layers carry trainable
    adapters, sharded by the plain executor (the frozen weights only) and opted in as trainable;
    calls equal, divergent and none (per_layer, root, skip): after every microbatch the mean
    gradients and, after a step, the parameters equal the unsharded model's on both ranks' batches,
    and both ranks made the same all-gathers (each unit once a microbatch, kept for the backward).
    Again with each layer under activation checkpointing (its forward, and the executor's hooks, run
    again in the backward): the same, with no further all-gather."""
    for args in ((), ("checkpoint",)):
        for out in two_ranks(tmp_path, f"adapter{len(args)}", ADAPTER_RANKS, 90, args):
            result = result_of(out)
            assert result["worst_grad_diff"] <= 1e-6, result
            assert result["checkpoint"] == bool(args), result


def test_padded_with_divergent_calls_issues_the_same_all_gathers_on_every_rank(tmp_path):
    """tests/python/padded_ranks.py: two Gloo ranks calling a tower 2 and 0 times, 3 and 1, 1 and
    2 (and uniform, and no calls) under ("padded", K): no hang, each rank issues the same
    all-gathers in the same order (sizes differ per unit, so a mispairing would show), K passes
    over the tower's 4 units, the outputs are those of the unsharded model (checked in the rank),
    and the tower's peak is its shards plus one unit (plus the rest unit during a real call).
    Then two padded towers in one microbatch (the pad chain): one rank calls the first and pads the
    second, the other the reverse, one calls both and the other neither: the same all-gathers on
    both ranks, the first tower's passes before the second's, outputs bitwise the unsharded ones."""
    results = [result_of(out) for out in two_ranks(tmp_path, "padded", PADDED_RANKS, 90)]
    rest, layers, projector = 144, [96, 80, 64], 48  # Full bytes of each unit (padded to 2 ranks).
    one_pass = [rest] + layers
    passes = [2, 3, 2, 2, 0, 2]  # K per microbatch of padded_ranks.CALLS (per_layer: 2, skip: 0).
    zero, one = results
    for mb, k in enumerate(passes):
        a, b = zero["microbatches"][mb], one["microbatches"][mb]
        assert a["sizes"] == b["sizes"] == [projector] + one_pass * k, (mb, a, b)
        assert a["gathers"] == b["gathers"] == 1 + len(one_pass) * k, (mb, a, b)
    shard = zero["shard"]
    assert shard == one["shard"] == (rest + sum(layers)) // 2
    # Rank 1 only padded in microbatch 0: one unit at a time. A real call holds the rest and a layer.
    assert one["microbatches"][0]["peak"] == shard + max(one_pass)
    for res in results:
        assert res["after_error"]["peak"] == shard + rest + max(layers) < shard + rest + sum(layers)
    # A call beyond the plan: refused before it gathers, reported again by end_microbatch, and
    # the next microbatch still pairs (checked as the others).
    beyond = zero["beyond_plan"]
    assert "called under `padded` (call 2 of the microbatch), but this rank planned 1 call(s)" in beyond["refused"]
    assert "'visual' ran 2 call(s), planned 1" in beyond["ended"] and "no longer matched" in beyond["ended"]
    assert beyond["resident"] == shard, "end_microbatch released everything before raising"
    assert one["beyond_plan"] == {"refused": "", "ended": "", "resident": shard}
    assert zero["after_error"]["sizes"] == one["after_error"]["sizes"] == [projector] + one_pass * 2
    # The pad chain (padded_ranks.CHAIN_CALLS): the audio tower's K passes, then the vision tower's,
    # on both ranks, whichever tower each rank calls or pads (the units' sizes all differ).
    audio, vision = [192, 144, 72], [128, 112]  # Full bytes: rest, layers.0, layers.1; blocks.0, blocks.1.
    passes = [(1, 1), (2, 1), (1, 2), (1, 1), (2, 0)]  # (K audio, K vision) per microbatch.
    for mb, (ka, kv) in enumerate(passes):
        a, b = zero["chain"]["microbatches"][mb], one["chain"]["microbatches"][mb]
        assert a["sizes"] == b["sizes"] == audio * ka + vision * kv, (mb, a, b)
    shard = zero["chain"]["shard"]
    assert shard == one["chain"]["shard"] == sum(audio + vision) // 2
    # Pads and real calls hold one unit at a time (a real audio call: its rest unit and a layer).
    assert one["chain"]["microbatches"][0]["peak"] == shard + max(audio + vision), "rank 1 padded audio, ran vision"
    assert zero["chain"]["microbatches"][-1]["peak"] == shard + audio[0] + audio[1] < shard + sum(audio)


def test_root_with_media_on_rank_zero_only_does_not_hang(trainer_daemon, tmp_path):
    run = train(trainer_daemon, tmp_path, "root", "rank0")
    expect_healthy(run)
    assert "root=12" in run[0].summary  # 2 modules x 6 microbatches.
    # The executor's memory counts reached the coordinator: `shardctl ranks` shows them.
    shardctl = os.environ.get("SHARDCTL")
    if not shardctl:
        pytest.skip("SHARDCTL is not set: run through ctest")
    ranks = subprocess.run([shardctl, "ranks", "--json", "--coordinator", trainer_daemon.address],
                           capture_output=True, text=True, timeout=30)
    assert ranks.returncode == 0, ranks.stderr
    usage = [m for rank in json.loads(ranks.stdout)["ranks"] for m in rank.get("memory", [])]
    visual = [m for m in usage if m["module"] == "model.visual"]
    assert visual, ranks.stdout
    # model.visual: 3 blocks, 2656 floats (10624 bytes) gathered whole once per microbatch under
    # root, 6 microbatches; peak = the 5312-byte shard plus one full buffer (as the C++ trainer).
    assert {(m["resident_bytes"], m["peak_bytes"], m["gathered_bytes"]) for m in visual} == {("5312", "15936", "63744")}


def test_per_layer_with_every_rank_skipping_under_accumulation(trainer_daemon, tmp_path):
    run = train(trainer_daemon, tmp_path, "per_layer", "none")
    expect_healthy(run)
    assert "skip=12" in run[0].summary
    assert "gathered_bytes=0" in run[0].summary


def test_replicate_with_asymmetric_media(trainer_daemon, tmp_path):
    run = train(trainer_daemon, tmp_path, "replicate", "rank0")
    expect_healthy(run)
    assert "replicate=12" in run[0].summary
    assert "gathered_bytes=13792" in run[0].summary, "each module gathered once, then resident"


def test_per_layer_requested_with_asymmetric_media_falls_back_and_matches_root(trainer_daemon, tmp_path):
    per_layer = train(trainer_daemon, tmp_path, "per_layer", "rank0")
    root = train(trainer_daemon, tmp_path, "root", "rank0")
    expect_healthy(per_layer)
    expect_healthy(root)
    assert "fallbacks=12" in per_layer[0].summary
    for r in range(2):
        assert per_layer[r].losses == root[r].losses, f"rank {r}"
    assert per_layer[0].params_hash == root[0].params_hash


def test_fallback_padded_with_asymmetric_media_matches_the_unsharded_model_at_per_layers_peak(trainer_daemon,
                                                                                               tmp_path):
    # Decisions from the coordinator (fallback padded), carried out by the plain executor: rank 1
    # (no images) makes a gather-only pass over the tower, then the projector (the manifest is in
    # forward order), while rank 0 runs them; both gather the same bytes, as the unsharded model
    # computes, holding one unit where root holds the whole tower.
    reference = train(trainer_daemon, tmp_path, "per_layer", "rank0", "--no-shard")
    padded = train(trainer_daemon, tmp_path, "per_layer", "rank0", "--fallback", "padded")
    root = train(trainer_daemon, tmp_path, "per_layer", "rank0", "--fallback", "root")
    for run in (reference, padded, root):
        expect_healthy(run)
    field = lambda res, name: int(res.summary.split(f" {name}=")[1].split()[0])  # noqa: E731
    for r in range(2):
        assert "padded=12" in padded[r].summary and "fallbacks=12" in padded[r].summary, padded[r].summary
        assert padded[r].losses == reference[r].losses, f"rank {r}"
    assert padded[0].params_hash == reference[0].params_hash
    assert field(padded[0], "gathered_bytes") == field(padded[1], "gathered_bytes")
    assert field(padded[1], "peak_frozen_bytes") < field(root[1], "peak_frozen_bytes")


def test_every_policy_computes_exactly_what_the_unsharded_model_does(trainer_daemon, tmp_path):
    # --seed 4 --image-fraction 0.6: per microbatch per_layer, skip, root, per_layer, root, root
    # under auto, so asymmetric microbatches sit between per_layer ones.
    mix = ["--seed", "4", "--image-fraction", "0.6"]
    reference = train(trainer_daemon, tmp_path, "auto", "mixed", "--no-shard", *mix)
    expect_healthy(reference)
    for policy in ("auto", "per_layer", "root", "replicate"):
        run = train(trainer_daemon, tmp_path, policy, "mixed", *mix)
        expect_healthy(run)
        for r in range(2):
            assert run[r].losses == reference[r].losses, f"{policy}, rank {r}"
        assert run[0].params_hash == reference[0].params_hash, policy
        if policy == "auto":
            assert "per_layer=4 skip=2 root=6" in run[0].summary, run[0].summary
            assert "fallbacks=6" in run[0].summary


def test_four_ranks_in_two_groups_with_skewed_media(trainer_daemon, tmp_path):
    # Shard groups {0, 1} and {2, 3} (shard_process_group), data parallel over all four.
    run = train(trainer_daemon, tmp_path, "auto", "mixed", "--skew", "0.3", world=4, group=2)
    expect_healthy(run)
    reference = train(trainer_daemon, tmp_path, "auto", "mixed", "--skew", "0.3", "--no-shard", world=4, group=2)
    expect_healthy(reference)
    for r in range(4):
        assert run[r].losses == reference[r].losses, f"rank {r}"
    assert run[0].params_hash == reference[0].params_hash
    decisions = [res.summary.split(": ", 1)[1] for res in run]  # "decisions per_layer=... gathered_bytes=..."
    assert decisions[0] == decisions[1] and decisions[2] == decisions[3], "one decision per group"
    assert decisions[0] != decisions[2], "the two groups decide independently (skewed media)"


def start_long_run(daemon, tmp_path, job, world, group, procs, until_step, deadline_s):
    """Starts `world` ranks of a long run into `procs` and returns once rank 0 printed
    `until_step` (bounded by `deadline_s`; fails if a rank stops early)."""
    for r in range(world):
        argv = rank_argv(daemon, tmp_path, job, r, world, group, ["--media", "mixed", "--steps", "2000",
                                                                  "--interval-ms", "10", "--collective-timeout", "60"])
        procs.append(start(tmp_path, f"{job}-{r}", argv, {"SHARDCOORD_LOG_LEVEL": "error"}))
    deadline = time.monotonic() + deadline_s
    while f"step {until_step} " not in (tmp_path / f"{job}-0.out").read_text():
        assert time.monotonic() < deadline, f"rank 0 did not reach step {until_step} in {deadline_s} s: " + \
            (tmp_path / f"{job}-0.err").read_text()
        assert all(p.poll() is None for p in procs), "a rank stopped early"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_a_lost_rank_stops_the_other_naming_it(daemon, tmp_path, sig):
    """kill -9: the session ends at once. SIGSTOP: the rank hangs with its sockets open, so only the
    coordinator's heartbeat verdict can end rank 0's wait (in a decision or in a Gloo collective;
    the collective timeout is 60 s, far beyond the bound checked)."""
    heartbeat_timeout = 1.5  # The `daemon` fixture's.
    procs = []
    try:
        start_long_run(daemon, tmp_path, "lost", 2, 2, procs, until_step=20, deadline_s=60)
        procs[1].send_signal(sig)
        lost = time.monotonic()
        code = wait_code(procs[0], lost + heartbeat_timeout + 15)
        elapsed = time.monotonic() - lost
    finally:
        stop_all(procs)  # SIGKILL ends a stopped process too.
    err = (tmp_path / "lost-0.err").read_text()
    assert code != -1, "rank 0 hangs after rank 1 was lost"
    assert code == 3, err
    assert "rank 1 declared dead" in err
    assert elapsed < heartbeat_timeout + 15


def test_a_rank_hung_in_another_group_stops_the_whole_job_naming_it(daemon, tmp_path):
    """Groups {0, 1} and {2, 3}; rank 3 is stopped (SIGSTOP: its sockets stay open, so the world's
    gradient all-reduce neither completes nor fails). Rank 2 learns it from its group's failure;
    ranks 0 and 1 from the coordinator's notice to the other groups, while they wait in that
    all-reduce (its own timeout is 60 s, far beyond the bound checked)."""
    heartbeat_timeout = 1.5  # The `daemon` fixture's.
    procs = []
    try:
        start_long_run(daemon, tmp_path, "lost4", 4, 2, procs, until_step=10, deadline_s=90)
        procs[3].send_signal(signal.SIGSTOP)
        lost = time.monotonic()
        codes = [wait_code(p, lost + heartbeat_timeout + 20) for p in procs[:3]]
    finally:
        stop_all(procs)
    errs = [(tmp_path / f"lost4-{r}.err").read_text() for r in range(3)]
    for r in range(3):
        assert codes[r] != -1, f"rank {r} hangs after rank 3 was lost: {errs[r]}"
        assert codes[r] == 3, errs[r]
        assert "rank 3 declared dead" in errs[r], errs[r]
    for r in (0, 1):
        assert "another shard group" in errs[r], errs[r]


def test_the_local_launcher_runs_every_rank(trainer_daemon, tmp_path):
    p = start(tmp_path, "launch", [sys.executable, str(VLM_TRAIN), "--nproc", "2", "--coordinator",
                                   trainer_daemon.address, "--job", "launched", "--steps", "2", "--accum", "1"])
    try:
        code = wait_code(p, time.monotonic() + RUN_DEADLINE)
    finally:
        stop_all([p])
    out = (tmp_path / "launch.out").read_text()
    assert code == 0, out + (tmp_path / "launch.err").read_text()
    hashes = {line.split()[-1] for line in out.splitlines() if "final params hash" in line}
    assert len(hashes) == 1, out
    for r in range(2):
        assert f"[rank {r}] step 1 loss " in out and f"[rank {r}] summary rank {r}:" in out, out


def test_bad_flags_are_refused_before_anything_starts():
    import torch

    def run(*flags):
        return subprocess.run([sys.executable, str(VLM_TRAIN), "--rank", "0", "--world-size", "2",
                               "--init-method", "file:///nonexistent", *flags], capture_output=True, text=True,
                              timeout=60)

    fsdp2_ok = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)
    r = run("--fsdp2")
    if not fsdp2_ok:  # Debian's torch 1.13: FSDP2 is not there; say so and what to do instead.
        assert r.returncode == 2 and "--fsdp2 needs torch >= 2.6" in r.stderr and "leave --fsdp2 out" in r.stderr
    r = run("--fsdp2", "--group-size", "1")
    assert r.returncode == 2 and ("--group-size must be the world size (2)" in r.stderr or not fsdp2_ok), r.stderr
    r = run("--steps", "0")
    assert r.returncode == 2 and "--steps and --accum must be >= 1" in r.stderr, r.stderr


def test_policy_matrix_harness_parses_its_flags_without_torch():
    # bench/policy_matrix.py runs on the GPU machine; here: its launcher imports no torch and
    # refuses bad flags clearly.
    matrix = ROOT / "bench" / "policy_matrix.py"
    r = subprocess.run([sys.executable, str(matrix), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "sc_auto" in r.stdout and "alternating" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, str(matrix)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--shardcoordd is required" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, str(matrix), "--shardcoordd", "x", "--mixes", "bogus"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "unknown mix 'bogus'" in r.stderr and "qwen25vl_sft" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, str(matrix), "--shardcoordd", "x", "--gpus", "6", "--group-size", "4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--gpus 6 must be >= 1 and a multiple of --group-size 4" in r.stderr, r.stderr


def test_the_readmes_minimal_loop_trains_two_ranks_to_the_same_parameters(trainer_daemon, tmp_path):
    """examples/python/minimal_loop.py, the loop the README shows, as torchrun would start it."""
    import socket
    with socket.socket() as s:  # A free port for torch's env:// rendezvous (never a fixed one).
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = f"minimal-{next(_jobs)}"
    procs = [start(tmp_path, f"{job}-{r}", [sys.executable, str(ROOT / "examples" / "python" / "minimal_loop.py")],
                   {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "SHARDCOORD_ADDR": trainer_daemon.address, "JOB": job, "SHARDCOORD_LOG_LEVEL": "warn"})
             for r in range(2)]
    try:
        deadline = time.monotonic() + RUN_DEADLINE
        codes = [wait_code(p, deadline) for p in procs]
    finally:
        stop_all(procs)
    outs = [(tmp_path / f"{job}-{r}.out").read_text().splitlines() for r in range(2)]
    errs = [(tmp_path / f"{job}-{r}.err").read_text() for r in range(2)]
    assert codes == [0, 0], errs
    decisions = [[line.split(" ", 2)[2] for line in out if " step " in line] for out in outs]
    assert decisions[0] == decisions[1] and len(decisions[0]) == 8, outs
    kinds = {d.rsplit(" ", 1)[1] for d in decisions[0]}
    assert {"per_layer", "skip", "root"} <= kinds, decisions[0]
    finals = [out[-1].rsplit(" ", 1)[1] for out in outs]
    assert finals[0] == finals[1] and outs[0][-1].startswith("rank 0 final params hash"), outs
