#!/usr/bin/env python3
"""Coordinator restart trials (DESIGN 12; results in docs/RELIABILITY.md). Standard library only.

Each trial runs a real job (8 `shardctl replay --per-rank` rank processes, 2 shard groups of 4,
a mixed trace) against a real shardcoordd, kills the daemon with SIGKILL at a random moment
(before, during or after registration, mid-run), keeps it down for a random time and starts a
new one on the same address. It then records:

  hang           a rank that did not exit within its bound (it is killed)
  failure        a rank that exited nonzero
  contradiction  `shardctl verify` over the 8 per-rank outputs does not say every rank of each
                 group agrees, or an output misses decisions
  resume         per rank that resumed: the time from the new daemon's start to the rank's
                 "resumed with coordinator" line; the trial's time to resume is the slowest
                 rank's (p50 / p99 over trials)

  bench/restart_trials.py --trials 100            # the documented run
  bench/restart_trials.py --trials 5 --build build

Exit code 0 when no trial hung, failed or contradicted; 1 otherwise; 2 setup error.
"""

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

WORLD, GROUP = 8, 4
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}) .*resumed with coordinator", re.M)


def write_trace(path, microbatches):
    with open(path, "w") as out:
        for i in range(microbatches):
            for r in range(WORLD):
                vision = 1 if i % 3 == 0 else 0 if i % 3 == 1 else r % 2
                out.write('{"rank":%d,"step":%d,"microbatch":%d,"calls":{"vision_tower":%d,"audio_tower":0}}\n'
                          % (r, i // 4, i % 4, vision))


def start_daemon(build, listen, workdir, name):
    addr_file = os.path.join(workdir, name + ".addr")
    log = open(os.path.join(workdir, name + ".err"), "w")
    proc = subprocess.Popen([os.path.join(build, "coordinator", "shardcoordd"), "--listen", listen, "--address-file",
                             addr_file, "--heartbeat-interval-ms", "100", "--heartbeat-timeout-ms", "2000"],
                            stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if os.path.exists(addr_file) and ":" in open(addr_file).read():
            return proc, open(addr_file).read().strip()
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError("shardcoordd did not start: " + open(os.path.join(workdir, name + ".err")).read())


def log_time(stamp):
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()


def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100.0 * (len(s) - 1))))]


def run_trial(args, trial, rng, trace, workdir):
    tdir = os.path.join(workdir, "trial%03d" % trial)
    os.makedirs(tdir)
    daemon, address = start_daemon(args.build, "127.0.0.1:0", tdir, "daemon1")
    shardctl = os.path.join(args.build, "client", "shardctl")
    ranks = []
    for r in range(WORLD):
        ranks.append(subprocess.Popen(
            [shardctl, "replay", trace, "--coordinator", address, "--job-id", "t%d" % trial, "--world-size",
             str(WORLD), "--group-size", str(GROUP), "--ranks", str(r), "--interval-ms", str(args.interval_ms),
             "--per-rank", "--output", os.path.join(tdir, "rank%d.jsonl" % r), "--decision-timeout-ms", "60000",
             "--reconnect-window-ms", "30000"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tdir, "rank%d.err" % r), "w")))
    kill_at = rng.uniform(0.05, args.max_kill_s)
    down = rng.uniform(0.0, args.max_down_s)
    time.sleep(kill_at)
    daemon.kill()
    daemon.wait()
    time.sleep(down)
    restarted_at = time.time()
    daemon, _ = start_daemon(args.build, address, tdir, "daemon2")
    result = {"trial": trial, "kill_at_s": kill_at, "down_s": down, "hang": 0, "failure": 0, "contradiction": 0,
              "resumed_ranks": 0, "resume_s": None}
    deadline = time.monotonic() + args.rank_timeout_s
    for r, p in enumerate(ranks):
        try:
            code = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            result["hang"] += 1
            continue
        if code != 0:
            result["failure"] += 1
    resumes = []
    for r in range(WORLD):
        for stamp in LOG_TIME.findall(open(os.path.join(tdir, "rank%d.err" % r)).read()):
            resumes.append(log_time(stamp) - restarted_at)
    result["resumed_ranks"] = len(resumes)
    if resumes:
        result["resume_s"] = max(resumes)
    if result["hang"] == 0 and result["failure"] == 0:
        outputs = [os.path.join(tdir, "rank%d.jsonl" % r) for r in range(WORLD)]
        complete = all(sum(1 for _ in open(o)) == 2 * args.microbatches for o in outputs)
        v = subprocess.run([shardctl, "verify"] + outputs, capture_output=True, text=True, timeout=60)
        if v.returncode != 0 or "all ranks of each group agree" not in v.stdout or not complete:
            result["contradiction"] = 1
            result["verify"] = (v.stdout + v.stderr).strip()[-300:]
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=10)
    except subprocess.TimeoutExpired:
        daemon.kill()
    bad = result["hang"] or result["failure"] or result["contradiction"]
    if not bad and not args.keep_logs:
        subprocess.run(["rm", "-rf", tdir])
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--build", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
    ap.add_argument("--microbatches", type=int, default=80, help="per rank")
    ap.add_argument("--interval-ms", type=int, default=20, help="pause after each microbatch")
    ap.add_argument("--max-kill-s", type=float, default=2.0, help="kill the daemon at U(0.05, this) s")
    ap.add_argument("--max-down-s", type=float, default=1.0, help="keep it down U(0, this) s")
    ap.add_argument("--rank-timeout-s", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="logs (default: a new temporary directory)")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    for tool in ("coordinator/shardcoordd", "client/shardctl"):
        if not os.access(os.path.join(args.build, tool), os.X_OK):
            print("restart_trials: %s/%s is missing: build first (scripts/build.sh)" % (args.build, tool),
                  file=sys.stderr)
            return 2
    workdir = args.out or tempfile.mkdtemp(prefix="restart-trials-")
    os.makedirs(workdir, exist_ok=True)
    trace = os.path.join(workdir, "trace.jsonl")
    write_trace(trace, args.microbatches)
    rng = random.Random(args.seed)
    results = []
    started = time.monotonic()
    for t in range(args.trials):
        r = run_trial(args, t, rng, trace, workdir)
        results.append(r)
        print("trial %3d kill_at=%.2fs down=%.2fs resumed_ranks=%d resume=%s hang=%d failure=%d contradiction=%d%s"
              % (t, r["kill_at_s"], r["down_s"], r["resumed_ranks"],
                 "%.3fs" % r["resume_s"] if r["resume_s"] is not None else "-", r["hang"], r["failure"],
                 r["contradiction"], (" verify: " + r["verify"]) if "verify" in r else ""), flush=True)
    resumed = [r["resume_s"] for r in results if r["resume_s"] is not None]
    totals = {k: sum(r[k] for r in results) for k in ("hang", "failure", "contradiction")}
    print("\nsummary: trials=%d (%d with a resume) hangs=%d failures=%d contradictions=%d "
          "time_to_resume p50=%.3fs p99=%.3fs max=%.3fs wall=%.0fs logs=%s"
          % (len(results), len(resumed), totals["hang"], totals["failure"], totals["contradiction"],
             percentile(resumed, 50), percentile(resumed, 99), max(resumed) if resumed else float("nan"),
             time.monotonic() - started, workdir))
    return 1 if any(totals.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
