"""A real Prometheus (Debian's `prometheus`) scrapes a daemon running real jobs: every series that
docs/METRICS.md documents comes back with its documented labels, none with an `exported_*` label,
and every query of the Grafana dashboard (deploy/grafana/shardcoord.json) returns data.

The jobs: `train`, the example trainer (examples/vlm_trainer, 2 CPU ranks over Gloo: decisions,
communicators, memory reports) running for the whole test; `hurt`, two ranks of which one is a
process killed with SIGKILL (a death, a failed group, a death detection time). Then the daemon
is restarted on the same addresses (SIGTERM, then a new process with the same state file): the
trainer resumes, Prometheus scrapes the new incarnation, and the recovery shows in its series."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

import shardcoord
from conftest import Daemon, stop_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRAPE_JOB = "shardcoordd"
MODULES = [shardcoord.ModuleSpec("model.visual", 4096), shardcoord.ModuleSpec("model.audio_tower", 1024)]


def documented_series():
    """(series, labels) from the table in docs/METRICS.md."""
    text = open(os.path.join(ROOT, "docs", "METRICS.md")).read()
    table = text.split("<!-- metrics-table", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1], re.findall(r"`([a-z_]+)`", cells[2])))
    assert len(rows) > 30, "the metrics table of docs/METRICS.md was not found"
    return rows


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SECURED_JOB = "shardcoordd-tls"


def secured_daemon(tmp_path):
    """A daemon serving HTTPS with tokens (as every deploy file does), and Prometheus' scrape
    job for it the way deploy/README.md and servicemonitor.yaml say: https, the CA, the server
    name of the certificate, a read token."""
    d = tmp_path / "tls"
    d.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(d / "tls.key"), "-out", str(d / "tls.crt"), "-days", "2", "-subj", "/CN=shardcoordd",
                    "-addext", "subjectAltName=DNS:shardcoordd"], check=True, capture_output=True, timeout=60)
    read_token = "read-" + os.urandom(16).hex()
    (d / "tokens").write_text(f"admin admin-{os.urandom(16).hex()}\nread {read_token}\n")
    (d / "read-token").write_text(read_token + "\n")
    for f in ("tls.key", "tokens", "read-token"):
        os.chmod(d / f, 0o600)
    http_file = d / "http.addr"
    daemon = Daemon(tmp_path, "--tls-cert-file", str(d / "tls.crt"), "--tls-key-file", str(d / "tls.key"), "--token-file",
                    str(d / "tokens"), "--http-listen", "127.0.0.1:0", "--http-address-file", str(http_file),
                    name="secured")
    job = (f"  - job_name: {SECURED_JOB}\n    scheme: https\n    tls_config:\n      ca_file: {d / 'tls.crt'}\n"
           f"      server_name: shardcoordd\n    authorization:\n      type: Bearer\n"
           f"      credentials_file: {d / 'read-token'}\n    static_configs:\n"
           f"      - targets: ['{http_file.read_text().strip()}']\n")
    return daemon, job


class Prometheus:
    def __init__(self, tmp_path, target, extra_jobs=""):
        binary = shutil.which("prometheus")
        if binary is None:
            if os.environ.get("CI"):
                pytest.fail("prometheus is not installed: scripts/install-deps.sh test installs it")
            pytest.skip("prometheus is not installed (scripts/install-deps.sh test installs it)")
        config = tmp_path / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                          f"scrape_configs:\n  - job_name: {SCRAPE_JOB}\n    static_configs:\n"
                          f"      - targets: ['{target}']\n" + extra_jobs)
        self.log = open(tmp_path / "prometheus.log", "w")
        for _ in range(5):  # A port picked free can be taken before Prometheus binds it: pick again.
            self.url = f"http://127.0.0.1:{free_port()}"
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address={self.url[7:]}", "--log.level=warn"], stdout=self.log, stderr=self.log)
            if self._ready(60):
                return
            self.stop()
        pytest.fail(f"prometheus did not start: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")

    def _ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def query(self, expr):
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, expr, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}: `{expr}` returned nothing")

    def stop(self):
        stop_process(self.proc, grace=20)


def start_trainer(daemon, tmp_path):
    binary = os.environ.get("VLM_TRAINER")
    if not binary:
        pytest.fail("VLM_TRAINER is not set: run this test through ctest (the build needs LibTorch)")
    procs = []
    for r in (0, 1):
        log = open(tmp_path / f"train{r}.log", "w")
        procs.append(subprocess.Popen(
            [binary, "--coordinator", daemon.address, "--job", "train", "--rank", str(r), "--world-size", "2",
             "--group-size", "2", "--policy", "auto", "--media", "mixed", "--image-fraction", "0.5", "--skew", "0.3",
             "--steps", "100000", "--accum", "2", "--memory-budget-bytes", "1048576", "--interval-ms", "50"],
            stdout=subprocess.DEVNULL, stderr=log))
    return procs


VICTIM = """
import shardcoord, sys, time
w = shardcoord.Worker("hurt", [shardcoord.ModuleSpec("model.visual", 4096),
                               shardcoord.ModuleSpec("model.audio_tower", 1024)],
                      2, rank=1, world_size=2, address=sys.argv[1], connect_timeout=30)
print("registered", flush=True)
time.sleep(600)
"""


def kill_a_rank(daemon):
    """Job `hurt`: rank 0 here, rank 1 a process killed once both registered."""
    w0 = shardcoord.Worker("hurt", MODULES, 2, rank=0, world_size=2, address=daemon.address, connect_timeout=30)
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, daemon.address], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().strip() == "registered"
        w0.await_group_ready(timeout=30)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    return w0


def dashboard_queries():
    dash = json.load(open(os.path.join(ROOT, "deploy", "grafana", "shardcoord.json")))
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    variables = [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 20 and variables
    return exprs, variables


def instantiate(expr, job_id):
    return (expr.replace("$job_id", job_id).replace("$scrape_job", SCRAPE_JOB)
            .replace("$__rate_interval", "20s"))


def test_prometheus_scrapes_every_documented_series_and_the_dashboard_has_data(tmp_path):
    http_file = tmp_path / "http.addr"
    flags = ["--heartbeat-interval-ms", "100", "--heartbeat-timeout-ms", "3000", "--state-file",
             str(tmp_path / "state"), "--http-address-file", str(http_file)]
    daemon = Daemon(tmp_path, *flags, "--http-listen", "127.0.0.1:0")
    trainers, w0, prom, secured = [], None, None, None
    try:
        secured, secured_job = secured_daemon(tmp_path)
        prom = Prometheus(tmp_path, http_file.read_text().strip(), secured_job)
        trainers = start_trainer(daemon, tmp_path)
        w0 = kill_a_rank(daemon)
        prom.wait_for(f'shardcoord_events_total{{job="{SCRAPE_JOB}",kind="rank_dead"}} > 0', 60, "the death scraped")
        prom.wait_for('rate(shardcoord_module_decisions_total{job_id="train"}[20s]) > 0', 120,
                      "the trainer's decisions (see train0.log)")
        prom.wait_for('shardcoord_communicator_epoch{job_id="train"} > 0', 60, "the trainer's communicators")
        # Prometheus' own linter on what the daemon serves with jobs in it: no complaint at all.
        with urllib.request.urlopen(f"http://{http_file.read_text().strip()}/metrics", timeout=10) as r:
            exposition = r.read()
        lint = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, timeout=30)
        assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout.decode() + lint.stderr.decode()

        for name, kind, labels in documented_series():
            series = name + "_bucket" if kind == "histogram" else name
            result = prom.wait_for(f'{series}{{job="{SCRAPE_JOB}"}}', 30, f"documented series {name}")
            for r in result:
                got = set(r["metric"]) - {"__name__", "job", "instance"} - ({"le"} if kind == "histogram" else set())
                assert got == set(labels), f"{name}: labels {sorted(got)}, documented {labels}"

        # The HTTPS scrape with a read token, as deployed: up, and the daemon's series.
        prom.wait_for(f'up{{job="{SECURED_JOB}"}} == 1', 30, "the HTTPS scrape with a token")
        prom.wait_for(f'shardcoord_build_info{{job="{SECURED_JOB}"}}', 30, "series over HTTPS")

        # Every event kind the daemon counts is documented, and every documented kind is counted.
        counted = {r["metric"]["kind"] for r in prom.query(f'shardcoord_events_total{{job="{SCRAPE_JOB}"}}')}
        text = open(os.path.join(ROOT, "docs", "METRICS.md")).read()
        documented = set(re.findall(r"`([a-z_]+)`", text.split("The event kinds", 1)[1].split("\n\n", 1)[0]))
        documented.discard("shardcoord_events_total")
        assert counted == documented, f"counted, not documented: {counted - documented}; " \
                                      f"documented, not counted: {documented - counted}"

        everything = prom.query(f'{{__name__=~"shardcoord_.+|process_.+", job="{SCRAPE_JOB}"}}')
        assert len(everything) > 100
        clashes = [r["metric"] for r in everything if any(k.startswith("exported_") for k in r["metric"])]
        assert not clashes, f"series with a label renamed by Prometheus: {clashes[:3]}"
        # Every state present at zero (only live and dead ranks exist in job `hurt`).
        assert prom.query('shardcoord_ranks{job_id="hurt",state="unregistered"} == 0')
        assert prom.query('shardcoord_groups{job_id="train",state="recovering"} == 0')
        assert prom.query('shardcoord_events_total{kind="group_recovery_failed"} == 0')
        assert prom.query('shardcoord_module_decisions_total{job_id="hurt",module="model.audio_tower"} == 0')

        exprs, variables = dashboard_queries()
        for job_id in ("train", ".+"):  # One job picked, and "All".
            for title, expr in exprs:
                prom.wait_for(instantiate(expr, job_id), 30, f"dashboard panel '{title}' (job_id {job_id})")
        for definition in variables:
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", definition).groups()
            assert prom.query(f'count by ({label}) ({metric})'), f"dashboard variable {definition} has no values"

        # A restart: the trainer resumes under the new incarnation and its group recovers.
        w0.close(timeout=5)
        w0 = None
        http_address = http_file.read_text().strip()
        daemon.stop()
        daemon = Daemon(tmp_path, *flags, "--http-listen", http_address, listen=daemon.address, name="daemon2")
        prom.wait_for(f'changes(shardcoord_incarnation{{job="{SCRAPE_JOB}"}}[5m]) > 0', 60, "the new incarnation")
        prom.wait_for('shardcoord_group_recovery_seconds_count > 0', 90, "the trainer's group recovered")
        prom.wait_for('shardcoord_events_total{kind="rank_resumed"} >= 2', 30, "both trainer ranks resumed")
        prom.wait_for('increase(shardcoord_microbatches_decided_total{job_id="train"}[10s]) > 0', 60,
                      "decisions after the restart")
        assert all(p.poll() is None for p in trainers), "a trainer rank ended across the restart"
    finally:
        for p in trainers:
            p.kill()
            p.wait(10)
        if w0 is not None:
            w0.close(timeout=5)
        if prom is not None:
            prom.stop()
        if secured is not None:
            secured.stop()
        daemon.stop()
