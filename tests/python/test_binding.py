"""The Python binding against a real shardcoordd: decisions, typed errors, bad input, no hangs."""

import copy
import os
import pickle
import subprocess
import threading
import time

import pytest

import shardcoord
from conftest import Daemon

MODULES = [
    shardcoord.ModuleSpec("model.visual", 4096, (shardcoord.LayerUnit("blocks.0", 2048),
                                                 shardcoord.LayerUnit("blocks.1", 2048))),
    shardcoord.ModuleSpec("model.audio_tower", 1024),
]


def connect(daemon, rank, world=2, group=2, **kw):
    kw.setdefault("connect_timeout", 10)
    return shardcoord.Worker("job", MODULES, group, rank=rank, world_size=world, address=daemon.address, **kw)


def test_the_package_version_is_the_daemons(daemon):
    import re
    assert re.fullmatch(r"\d+\.\d+\.\d+", shardcoord.__version__), shardcoord.__version__
    out = subprocess.run([os.environ["SHARDCTL"], "status", "--coordinator", daemon.address], capture_output=True,
                         text=True, timeout=30)
    assert f"version {shardcoord.__version__} " in out.stdout, out.stdout + out.stderr


def test_the_worker_logs_which_daemon_version_it_reached(daemon):
    import sys
    code = ("import shardcoord; shardcoord.Worker('v', [shardcoord.ModuleSpec('model.visual', 8)], 1, rank=0, "
            f"world_size=1, address={daemon.address!r}, connect_timeout=10).close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, SHARDCOORD_LOG_LEVEL="info"))
    assert out.returncode == 0, out.stderr
    line = next((x for x in out.stderr.splitlines() if "registered coordinator=" in x), "")
    assert f"coordinator={daemon.address} (shardcoordd {shardcoord.__version__})" in line, out.stderr


def test_a_group_gets_one_identical_decision(daemon):
    with connect(daemon, 0) as w0, connect(daemon, 1) as w1:
        assert w0.group.ranks == [0, 1]
        assert w0.group.policy == "auto"
        w0.report_plan(0, 0, {"model.visual": 1, "model.audio_tower": 0})
        w1.report_plan(0, 0, {"model.visual": 1, "model.audio_tower": 0})
        d0 = w0.get_decision(0, 0, timeout=30)
        d1 = w1.get_decision(0, 0, timeout=30)
        assert d0 == d1
        assert d0["model.visual"] == shardcoord.ModuleDecision("per_layer", "uniform")
        assert d0["model.audio_tower"].decision == "skip"
        # Divergent: the fallback, root, on both.
        w0.report_plan(0, 1, {"model.visual": 1})
        w1.report_plan(0, 1, {"model.visual": 0})
        d0, d1 = w0.get_decision(0, 1), w1.get_decision(0, 1)
        assert d0.digest == d1.digest and d0.seq == d1.seq == 1
        assert d0["model.visual"] == shardcoord.ModuleDecision("root", "divergent")


def test_rank_and_world_come_from_torchrun_variables(daemon, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SHARDCOORD_ADDR", daemon.address)
    with shardcoord.Worker("job", MODULES, 2, connect_timeout=10) as w:
        assert w.rank == 1 and w.world_size == 2
    monkeypatch.delenv("RANK")
    with pytest.raises(shardcoord.InvalidArgument, match=r"torchrun sets \$RANK.*srun sets \$SLURM_PROCID"):
        shardcoord.Worker("job", MODULES, 2)


def test_rank_and_world_come_from_slurm_when_torchrun_did_not_start_the_task(daemon, monkeypatch):
    from shardcoord.worker import launcher_rank
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SHARDCOORD_ADDR", daemon.address)
    with shardcoord.Worker("job", MODULES, 2, connect_timeout=10) as w:
        assert (w.rank, w.world_size, w.launcher) == (1, 2, "Slurm")
    # torchrun inside an srun step: torchrun's numbering wins (its process groups use it).
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launcher_rank() == (0, 4, "torchrun")
    assert launcher_rank(3, 8) == (3, 8, "arguments")
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("SLURM_NTASKS", "two")
    with pytest.raises(shardcoord.InvalidArgument, match=r"\$SLURM_NTASKS='two' \(Slurm\) is not an integer"):
        launcher_rank()
    monkeypatch.delenv("SLURM_NTASKS")
    with pytest.raises(shardcoord.InvalidArgument, match=r"\$SLURM_NTASKS is not set.*Slurm task"):
        launcher_rank()


def test_shardctl_ranks_sums_huge_memory_reports_without_overflow(daemon):
    """A client's memory report is its own numbers: two of 2^62 bytes summed to a negative
    PEAK_FROZEN (signed overflow) in `shardctl ranks`."""
    with connect(daemon, 0, world=1, group=1) as w:
        w.report_memory([("model.visual", 2**62, 2**62, 0), ("model.audio_tower", 2**62, 2**62, 0)])
        deadline, line = time.monotonic() + 20, ""
        while time.monotonic() < deadline:
            out = subprocess.run([os.environ["SHARDCTL"], "ranks", "--job", "job", "--coordinator", daemon.address],
                                 capture_output=True, text=True, timeout=30)
            line = next((x for x in out.stdout.splitlines() if x.startswith("job ")), "")
            if "overflow" in line:  # The report arrives with a heartbeat: wait for it.
                break
            time.sleep(0.05)
        assert "overflow" in line, out.stdout + out.stderr


def test_cost_reports_make_auto_decide_by_cost(daemon):
    """Issue 28: both ranks report that gathering the tower costs twice its forward; a
    microbatch that calls it twice on every rank then gathers it once (root, reason cost)
    instead of once per call (per_layer), and the events say which numbers decided."""
    with connect(daemon, 0) as w0, connect(daemon, 1) as w1:
        for w in (w0, w1):
            w.report_costs([("model.visual", 0.010, [("blocks.0", 2048, 0.010), ("blocks.1", 2048, 0.010)])])
        deadline, events = time.monotonic() + 20, ""
        while time.monotonic() < deadline:  # The reports go with the next heartbeats: wait for the model.
            out = subprocess.run([os.environ["SHARDCTL"], "events", "--job", "job", "--coordinator", daemon.address],
                                 capture_output=True, text=True, timeout=30)
            events = out.stdout
            if "group_cost_model" in events:
                break
            time.sleep(0.05)
        assert "forward 0.0100 s/call, gather 0.0200 s" in events, events
        for w in (w0, w1):
            w.report_plan(0, 0, {"model.visual": 2, "model.audio_tower": 0})
        d0, d1 = w0.get_decision(0, 0, timeout=30), w1.get_decision(0, 0, timeout=30)
        assert d0 == d1
        assert d0["model.visual"] == shardcoord.ModuleDecision("root", "cost")
        with pytest.raises(ValueError):
            w0.report_costs([("model.visual", "fast", [])])


def test_a_trainer_stopping_on_an_error_is_recorded_failed_naming_it(daemon):
    """Issue 25: ranks that stopped because another died were "declared dead: session stream lost",
    and the ranks left behind named them instead of the first cause. Issue 43: recorded as "left
    cleanly", a job whose ranks all crashed looked finished. A rank that stops on an error is
    recorded failed with its error (state DEAD, reason "failed: ..."), an error event."""
    with pytest.raises(RuntimeError):
        with shardcoord.Worker("stops", MODULES, 1, rank=0, world_size=1, address=daemon.address,
                               connect_timeout=10):
            raise RuntimeError("rank 3 of another group was lost")
    out = subprocess.run([os.environ["SHARDCTL"], "ranks", "--job", "stops", "--json", "--coordinator",
                          daemon.address], capture_output=True, text=True, timeout=30)
    import json
    rank = json.loads(out.stdout)["ranks"][0]
    assert rank["state"] == "RANK_STATE_DEAD", rank
    reason = rank.get("dead_reason", rank.get("deadReason"))
    assert reason == "failed: RuntimeError: rank 3 of another group was lost", rank
    events = subprocess.run([os.environ["SHARDCTL"], "events", "--job", "stops", "--coordinator", daemon.address],
                            capture_output=True, text=True, timeout=30).stdout
    assert "rank 0 failed: RuntimeError" in events and "error" in events, events


def test_a_failed_rank_fails_its_group_naming_it_and_the_cause(daemon):
    w0 = shardcoord.Worker("fails", MODULES, 2, rank=0, world_size=2, address=daemon.address, connect_timeout=10)
    w1 = shardcoord.Worker("fails", MODULES, 2, rank=1, world_size=2, address=daemon.address, connect_timeout=10)
    try:
        w1.report_plan(0, 0, {"model.visual": 1, "model.audio_tower": 0})
        start = time.monotonic()
        w0.fail("FailedPrecondition: its plan named calls it did not make")
        with pytest.raises(shardcoord.GroupFailed,
                           match=r"rank 0 failed: FailedPrecondition: its plan named calls it did not make"):
            w1.get_decision(0, 0, timeout=20)
        assert time.monotonic() - start < 5, "the group fails at once, not at a heartbeat timeout"
    finally:
        w1.close()


def test_bad_input_raises_typed_errors_with_the_message(daemon):
    with connect(daemon, 0) as w:
        with pytest.raises(shardcoord.InvalidArgument, match="unknown module 'vison'"):
            w.report_plan(0, 0, {"vison": 1})
        with pytest.raises(shardcoord.InvalidArgument, match="step and microbatch must be >= 0"):
            w.report_plan(-1, 0, {})
        with pytest.raises(shardcoord.InvalidArgument, match="calls must be"):
            w.report_plan(0, 0, {"model.visual": -2})
        with pytest.raises(TypeError):
            w.report_plan("zero", 0, {})
        with pytest.raises(TypeError):
            w.report_plan(0, 0, {"model.visual": "one"})
        with pytest.raises(shardcoord.InvalidArgument, match="timeout"):
            w.get_decision(0, 0, timeout=-1)
        with pytest.raises(shardcoord.FailedPrecondition, match="no plan was reported"):
            w.get_decision(5, 0, timeout=1)
        w.report_plan(0, 0, {"model.visual": 1})
        with pytest.raises(shardcoord.FailedPrecondition, match="out-of-order"):
            w.report_plan(0, 0, {"model.visual": 1})
        # Rank 1 never plans: the wait ends at its deadline, naming what is missing.
        start = time.monotonic()
        with pytest.raises(shardcoord.DeadlineExceeded, match="has not reported its plan"):
            w.get_decision(0, 0, timeout=0.3)
        assert time.monotonic() - start < 15
    with pytest.raises(shardcoord.InvalidArgument, match="unknown policy 'fastest'"):
        connect(daemon, 1, policy="fastest")
    with pytest.raises(shardcoord.InvalidArgument, match="unknown rank 7"):
        connect(daemon, 7)


def test_registration_errors_carry_the_coordinators_code(daemon):
    with connect(daemon, 0):
        with pytest.raises(shardcoord.AlreadyExists, match="duplicate rank 0"):
            connect(daemon, 0)
        with pytest.raises(shardcoord.FailedPrecondition, match="world size mismatch"):
            connect(daemon, 1, world=4)


def test_a_peer_that_leaves_ends_the_wait_with_the_reason(daemon):
    with connect(daemon, 0) as w0:
        w1 = connect(daemon, 1)
        w0.report_plan(0, 0, {"model.visual": 1})
        w1.close()  # A clean leave without planning (0,0): it can never be decided.
        start = time.monotonic()
        # Whichever reaches the coordinator first, w0's plan or w1's goodbye, the reason names rank 1.
        with pytest.raises(shardcoord.FailedPrecondition,
                           match=r"can never be decided: ranks? 1 (left the job|already planned later .* or left)"):
            w0.get_decision(0, 0, timeout=30)
        assert time.monotonic() - start < 15
        with pytest.raises(shardcoord.Unavailable, match="session with coordinator"):
            w1.health()


def test_an_unreachable_coordinator_fails_connect_within_its_timeout():
    start = time.monotonic()
    with pytest.raises(shardcoord.Unavailable, match="cannot reach coordinator at 127.0.0.1:1"):
        shardcoord.Worker("job", MODULES, 1, rank=0, world_size=1, address="127.0.0.1:1", connect_timeout=0.5)
    assert time.monotonic() - start < 15


def test_a_restarted_coordinator_is_resumed_and_held_decisions_stay(tmp_path):
    flags = ("--heartbeat-interval-ms", "100", "--heartbeat-timeout-ms", "1500")
    first = Daemon(tmp_path, *flags)
    second = None
    w0 = connect(first, 0, reconnect_window=30)
    w1 = connect(first, 1, reconnect_window=30)
    try:
        w0.report_plan(0, 0, {"model.visual": 1})
        w1.report_plan(0, 0, {"model.visual": 1})
        d00 = w0.get_decision(0, 0, timeout=30)
        deadline = time.monotonic() + 30
        while w1.undecided_plans and time.monotonic() < deadline:  # (0, 0) reached rank 1 too
            time.sleep(0.01)
        assert w1.undecided_plans == 0
        w0.report_plan(0, 1, {"model.visual": 0})
        first.proc.kill()  # kill -9: no goodbye, no shutdown notice
        first.proc.wait(10)
        # Held while the coordinator is away: rank 1 still takes (0, 0).
        assert w1.get_decision(0, 0, timeout=30) == d00
        second = Daemon(tmp_path, *flags, listen=first.address, name="daemon2")
        w1.report_plan(0, 1, {"model.visual": 0})
        d01 = w0.get_decision(0, 1, timeout=30)
        assert d01 == w1.get_decision(0, 1, timeout=30)
        assert d01.seq == d00.seq + 1, "seq goes on after the restart"
        w0.health()
        w1.health()
    finally:
        w0.close()
        w1.close()
        first.stop()
        if second:
            second.stop()
    with pytest.raises(shardcoord.InvalidArgument, match="reconnect_window"):
        shardcoord.Worker("job", MODULES, 1, rank=0, world_size=1, address="127.0.0.1:1", reconnect_window=-1)


def test_get_decision_releases_the_gil(daemon):
    with connect(daemon, 0) as w0, connect(daemon, 1) as w1:
        w0.report_plan(0, 0, {"model.visual": 1})
        ticks = []
        stop = threading.Event()

        def count():
            while not stop.is_set():
                ticks.append(1)
                time.sleep(0.005)

        t = threading.Thread(target=count)
        t.start()
        with pytest.raises(shardcoord.DeadlineExceeded):
            w0.get_decision(0, 0, timeout=0.5)  # Rank 1 has not planned.
        stop.set()
        t.join(5)
        assert len(ticks) > 10, "another Python thread must run while get_decision waits"


def test_classify_is_the_contracts_classifier():
    nodes = [("", 10, 4), ("model", 10, 4), ("model.visual", 4, 0), ("model.visual.merger", 1, 0),
             ("model.multi_modal_projector", 2, 2), ("model.language_model", 4, 4)]
    assert shardcoord.classify(nodes) == [("model.multi_modal_projector", "projector", False),
                                          ("model.visual", "tower", True)]
    assert shardcoord.classify([("enc", 1, 0)], extra_towers=["enc"]) == [("enc", "tower", True)]


def test_the_manifest_and_decisions_are_values():
    """The bound types compare, hash, print and pickle as the frozen dataclasses they replaced did."""
    spec = MODULES[0]
    assert spec.units == (shardcoord.LayerUnit("blocks.0", 2048), shardcoord.LayerUnit("blocks.1", 2048))
    assert spec == shardcoord.ModuleSpec("model.visual", 4096, list(spec.units)) != MODULES[1]
    assert len({spec, copy.deepcopy(spec), MODULES[1]}) == 2
    assert pickle.loads(pickle.dumps(MODULES)) == MODULES
    assert repr(MODULES[1]) == ("ModuleSpec(name='model.audio_tower', param_bytes=1024, units=(), "
                                "outside_inner_root=False, trainable=False)")
    with pytest.raises(AttributeError):
        spec.name = "model.audio"
    with pytest.raises(shardcoord.InvalidArgument, match="units must be shardcoord.LayerUnit, got tuple"):
        shardcoord.ModuleSpec("model.visual", 8, [("blocks.0", 8)])

    d = shardcoord.Decision(0, 3, 1, 2, 7, 99, {"model.visual": shardcoord.ModuleDecision("root", "divergent")})
    assert d["model.visual"] == shardcoord.ModuleDecision("root", "divergent") != shardcoord.ModuleDecision("root", "")
    assert d.modules is d.modules, "converted once, not at every access"
    assert pickle.loads(pickle.dumps(d)) == d != shardcoord.Decision(0, 3, 1, 2, 8, 99, d.modules)
    assert repr(d).startswith("Decision(group=0, step=3, microbatch=1, epoch=2, seq=7, digest=99, modules={")
    with pytest.raises(TypeError):
        hash(d)  # It holds a dict, as the dataclass did.
    with pytest.raises(shardcoord.InvalidArgument, match="map module names to shardcoord.ModuleDecision"):
        shardcoord.Decision(0, 0, 0, 0, 0, 0, {"model.visual": "root"})
    g = shardcoord.GroupInfo(0, [0, 1], 3, "auto", "root", 4, [])
    assert (g.ranks, g.policy, g.fallback) == ([0, 1], "auto", "root") and copy.copy(g) == g


def test_worker_options_are_built_with_keywords_and_checked_as_they_are_set():
    o = shardcoord.WorkerOptions(job_id="job", rank=1, world_size=2, group_size=2, modules=MODULES, policy="auto",
                                 token="rank-secret", tls=shardcoord.TlsOptions(ca_file="/ca.pem"))
    assert (o.job_id, o.rank, o.modules, o.policy, o.fallback) == ("job", 1, MODULES, "auto", "")
    assert (o.connect_timeout, o.reconnect_window, o.lookahead, o.wrap_outer_model) == (30.0, 30.0, 0, True)
    o.tls.server_name = "coordinator"
    assert (o.tls.ca_file, o.tls.server_name) == ("/ca.pem", "coordinator")
    assert "rank-secret" not in repr(o) and "token='***'" in repr(o)
    for bad, match in ((dict(policy="fastest"), "unknown policy 'fastest'"), (dict(fallback="skip"), "fallback"),
                       (dict(reconnect_window=-1), "reconnect_window"), (dict(lookahead=-1), "lookahead"),
                       (dict(memory_budget_bytes=-1), "memory_budget_bytes"),
                       (dict(modules=[("model.visual", 8)]), "modules must be shardcoord.ModuleSpec, got tuple")):
        with pytest.raises(shardcoord.InvalidArgument, match=match):
            shardcoord.WorkerOptions(**bad)
    with pytest.raises(TypeError, match="unexpected keyword argument 'adress'"):
        shardcoord.WorkerOptions(adress="127.0.0.1:1")
    with pytest.raises(TypeError):
        shardcoord.WorkerOptions("job")  # Keywords only.


def test_a_worker_connects_with_options_built_beforehand(daemon):
    def options(rank):
        return shardcoord.WorkerOptions(coordinator_address=daemon.address, job_id="job", rank=rank, world_size=2,
                                        group_size=2, modules=MODULES, fallback="replicate", connect_timeout=10)

    with shardcoord.Worker.from_options(options(0)) as w0, shardcoord.Worker.from_options(options(1)) as w1:
        assert (w1.rank, w1.world_size, w1.launcher) == (1, 2, "options")
        assert isinstance(w0.group, shardcoord.GroupInfo) and w0.group.fallback == "replicate"
        w0.report_plan(0, 0, {"model.visual": 1})
        w1.report_plan(0, 0, {"model.visual": 0})
        d = w0.get_decision(0, 0, timeout=30)
        assert isinstance(d, shardcoord.Decision) and d == w1.get_decision(0, 0, timeout=30)
        assert d["model.visual"] == shardcoord.ModuleDecision("replicate", "divergent")


def _openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def test_a_worker_reaches_a_tls_daemon_with_its_ca_and_a_token(tmp_path):
    """TLS and tokens (DESIGN 13): the CA and token from arguments or the environment."""
    key, cert, ext = str(tmp_path / "server.key"), str(tmp_path / "server.pem"), tmp_path / "ext"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key,
             "-out", cert, "-days", "2", "-subj", "/CN=localhost", "-addext",
             "subjectAltName=DNS:localhost,IP:127.0.0.1")
    os.chmod(key, 0o600)
    tokens = tmp_path / "tokens"
    tokens.write_text("rank rank-token-0123456789abcdef\n")
    os.chmod(tokens, 0o600)
    d = Daemon(tmp_path, "--tls-cert-file", cert, "--tls-key-file", key, "--token-file", str(tokens))
    try:
        with pytest.raises(shardcoord.Unavailable, match="If it serves TLS, give the CA file"):
            connect(d, 0, connect_timeout=2, token="rank-token-0123456789abcdef")
        with pytest.raises(shardcoord.InvalidArgument, match="cannot be read"):
            connect(d, 0, tls_ca=str(tmp_path / "missing.pem"))
        os.environ["SHARDCOORD_TOKEN"] = "rank-token-0123456789abcdef"
        try:
            with connect(d, 0, tls_ca=cert) as w0, connect(d, 1, tls_ca=cert) as w1:
                w0.report_plan(0, 0, {"model.visual": 1})
                w1.report_plan(0, 0, {"model.visual": 1})
                assert w0.get_decision(0, 0, timeout=30) == w1.get_decision(0, 0, timeout=30)
        finally:
            del os.environ["SHARDCOORD_TOKEN"]
        with pytest.raises(shardcoord.Unauthenticated):  # A wrong token: its own class (a PermissionDenied).
            connect(d, 0, tls_ca=cert, token="not-the-token-0123456789abcdef")
    finally:
        d.stop()


@pytest.mark.parametrize("address,said,within", [
    ("localhost", r"'localhost' is not HOST:PORT: no ':PORT'", 1.0),
    ("127.0.0.1:78710", r"the port 78710 is not in 1\.\.65535", 1.0),
    ("http://127.0.0.1:7871", r"a URL is not an address: give HOST:PORT without a scheme", 1.0),
    ("nohost.invalid:7871", r"the host 'nohost\.invalid' does not resolve", 5.0),  # The resolver's own time.
])
def test_a_wrong_coordinator_address_is_named_at_once(address, said, within):
    start = time.monotonic()
    with pytest.raises((shardcoord.InvalidArgument, shardcoord.FailedPrecondition), match=said):
        shardcoord.Worker("j", [], 1, rank=0, world_size=1, address=address, connect_timeout=20)
    assert time.monotonic() - start < within


def test_a_refused_address_says_nothing_listens(tmp_path):
    import socket
    with socket.socket() as s:  # A port nothing listens on: bound, never listened.
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(shardcoord.Unavailable, match=rf"connection refused: nothing listens on 127\.0\.0\.1:{port}"):
            shardcoord.Worker("j", [], 1, rank=0, world_size=1, address=f"127.0.0.1:{port}", connect_timeout=1.5)


def test_each_missing_identity_field_is_named():
    with pytest.raises(shardcoord.InvalidArgument, match=r"group_size must be >= 1 \(the FSDP shard group's size\), got 0"):
        shardcoord.Worker("j", [], 0, rank=0, world_size=1, address="127.0.0.1:7871")
    with pytest.raises(shardcoord.InvalidArgument, match=r"rank must be >= 0, got -1"):
        shardcoord.Worker("j", [], 1, rank=-1, world_size=2, address="127.0.0.1:7871")
    with pytest.raises(shardcoord.InvalidArgument, match=r"set \$SHARDCOORD_ADDR .* address= in Python"):
        shardcoord.Worker.from_options(shardcoord.WorkerOptions(job_id="j", rank=0, world_size=1, group_size=1))
