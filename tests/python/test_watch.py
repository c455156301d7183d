"""`shardctl watch` on a real terminal: a pty of 80x24 (its controlling terminal, so that a
resize sends SIGWINCH) against a real shardcoordd with a live job and finished ones. Frames are
read as they are drawn, each wait with a deadline; the keys are typed as a terminal sends them.
Also: `shardctl ranks` keeps its columns under job ids longer than 10 characters."""

import codecs
import errno
import fcntl
import json
import os
import re
import select
import struct
import subprocess
import termios
import time

import pytest

import shardcoord
from conftest import Daemon

FINISHED = "aa-finished-job-0001"  # The coordinator lists jobs by id: the finished ones come first there.
FINISHED_SHORT = "ab-done"
LIVE = "zz-live-training-job"
MODULES = [shardcoord.ModuleSpec("model.visual", 4096)]
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SGR = re.compile(r"\x1b\[[0-9;]*m")
WAIT = 20  # Seconds for anything to show on a loaded 2-core machine.


@pytest.fixture
def daemon(tmp_path):
    """Heartbeats every 200 ms, dead after 10 s silent: on a loaded 2-core machine (a build beside
    the test) a live rank must not be declared dead, which would change what the frames show."""
    d = Daemon(tmp_path, "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "10000")
    yield d
    d.stop()


def plain(text):
    return ESCAPES.sub("", text)


class Watch:
    """`shardctl watch` on the slave side of a pty; frames are read from the master. A frame is
    what the program writes between cursor home (ESC [H) and clear-below (ESC [J)."""

    def __init__(self, address, *args, rows=24, cols=80, env=None):
        self.master, slave = os.openpty()
        self.resize(rows, cols)
        environ = dict(os.environ, TERM="xterm-256color")
        environ.pop("NO_COLOR", None)
        environ.update(env or {})
        # setsid --ctty: a session of its own with the pty as controlling terminal (SIGWINCH).
        self.proc = subprocess.Popen(["setsid", "--ctty", os.environ["SHARDCTL"], "watch", "--coordinator", address,
                                      *args], stdin=slave, stdout=slave, stderr=slave, env=environ, close_fds=True)
        os.close(slave)
        self.raw = ""
        self.mark = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.ended = False

    def resize(self, rows, cols):
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def send(self, keys):
        """Types `keys`; frames drawn before this are not looked at again."""
        self.mark = len(self.raw)
        os.write(self.master, keys.encode())

    def _read(self, timeout):
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return
        try:
            data = os.read(self.master, 65536)
        except OSError as e:  # EIO: the program ended and closed the slave side.
            if e.errno != errno.EIO:
                raise
            data = b""
        if not data:
            self.ended = True
        self.raw += self.decoder.decode(data)

    def last_frame(self):
        end = self.raw.rfind("\x1b[J")
        start = self.raw.rfind("\x1b[H", self.mark, end if end >= 0 else None)
        if end < 0 or start < 0:
            return None
        return self.raw[start + 3:end]

    def frame(self, predicate, what):
        """The newest complete frame drawn since the last keys, once `predicate(lines)` holds for
        it; `lines` are its rows with the escape sequences taken out."""
        deadline = time.monotonic() + WAIT
        while True:
            frame = self.last_frame()
            if frame is not None and predicate(rows_of(frame)):
                return frame
            left = deadline - time.monotonic()
            assert left > 0 and not self.ended, (f"no frame with {what} within {WAIT} s (ended: {self.ended}); "
                                                 f"last frame:\n" + "\n".join(rows_of(frame or "")))
            self._read(min(left, 0.5))

    def wait_exit(self):
        """The exit code, once the program ended and all it wrote was read."""
        deadline = time.monotonic() + WAIT
        while not self.ended and time.monotonic() < deadline:
            self._read(0.2)
        assert self.ended, f"shardctl watch still writing or running {WAIT} s after q"
        return self.proc.wait(max(0.1, deadline - time.monotonic()))

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


def rows_of(frame):
    return [plain(line) for line in frame.replace("\r", "").split("\n")]


def rank_order(lines, job):
    """The ranks of `job` in the order its rank table lists them."""
    start = next(i for i, line in enumerate(lines) if line.startswith("JOB " + job + " "))
    header = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("RANK"))
    order = []
    for line in lines[header + 1:]:
        m = re.match(r"^\s+(\d+)\s+\d+\s+[a-z]+", line)
        if not m:
            break
        order.append(int(m.group(1)))
    return order


def status_line(lines):
    return next(line for line in lines if line.startswith("sort: ") or line.startswith("keys"))


def shardctl_json(daemon, *args):
    out = subprocess.run([os.environ["SHARDCTL"], *args, "--json", "--coordinator", daemon.address],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def worker(daemon, job, rank, world):
    return shardcoord.Worker(job, MODULES, world, rank=rank, world_size=world, address=daemon.address,
                             connect_timeout=10)


def finish_jobs(daemon, wait_for):
    """Two jobs whose ranks all left: one of two ranks with a long id, one of a rank with a short."""
    with worker(daemon, FINISHED, 0, 2), worker(daemon, FINISHED, 1, 2):
        pass
    with worker(daemon, FINISHED_SHORT, 0, 1):
        pass

    def left(job, n):
        jobs = shardctl_json(daemon, "status", "--job", job).get("jobs", [])
        return len(jobs) == 1 and jobs[0].get("ranks_left", 0) == n
    wait_for(lambda: left(FINISHED, 2) and left(FINISHED_SHORT, 1), WAIT, "the finished jobs' ranks to leave")


def start_live_job(daemon, wait_for):
    """Ranks 0 and 1 of 3 registered, rank 2 not yet; rank 0 sent 3 plans and rank 1 one."""
    w0, w1 = worker(daemon, LIVE, 0, 3), worker(daemon, LIVE, 1, 3)
    for mb in range(3):
        w0.report_plan(0, mb, {"model.visual": 1})
    w1.report_plan(0, 0, {"model.visual": 1})

    def plans():
        return {r["rank"]: int(r.get("plans_received", 0))
                for r in shardctl_json(daemon, "ranks", "--job", LIVE)["ranks"]}
    wait_for(lambda: plans() == {0: 3, 1: 1, 2: 0}, WAIT, "the coordinator to count the plans")
    return w0, w1


def check_fits(frame, rows, cols):
    lines = rows_of(frame)
    assert len(lines) <= rows, f"{len(lines)} rows drawn on a terminal of {rows}:\n" + "\n".join(lines)
    for line in lines:
        assert len(line) <= cols, f"a row of {len(line)} columns on a terminal of {cols}: {line!r}"
    return lines


def test_watch_on_a_terminal_is_coloured_sorted_filtered_scrolled_and_quits_on_q(daemon, wait_for):
    finish_jobs(daemon, wait_for)
    w0, w1 = start_live_job(daemon, wait_for)
    # A refresh only on `r`: every frame after the first is drawn from keys alone.
    watch = Watch(daemon.address, "--interval-ms", "3600000")
    try:
        frame = watch.frame(lambda ls: any(line.startswith("JOB " + LIVE) for line in ls), "the live job")
        lines = check_fits(frame, 24, 80)
        # Colour for states: live green, unregistered cyan, finished dim; the key line reversed.
        assert "\x1b[32mlive\x1b[0m" in frame and "\x1b[36munregistered\x1b[0m" in frame, frame
        assert "\x1b[2mJOB " + FINISHED in frame and "\x1b[7m" in frame, frame
        # The live job first (the coordinator lists it last); each finished job one line.
        live_at = next(i for i, line in enumerate(lines) if line.startswith("JOB " + LIVE + " "))
        done = [i for i, line in enumerate(lines) if line.startswith("JOB " + FINISHED)]
        short = [i for i, line in enumerate(lines) if line.startswith("JOB " + FINISHED_SHORT + " ")]
        assert len(done) == 1 and len(short) == 1 and live_at < done[0], "\n".join(lines)
        assert "finished" in lines[done[0]] and "2 left" in lines[done[0]], lines[done[0]]
        # Their columns line up whatever the length of the job id.
        assert lines[done[0]].index(" finished ") == lines[short[0]].index(" finished "), "\n".join(lines)
        assert lines[-1].startswith("q quit  h help  s sort  f filter"), lines[-1]
        assert rank_order(lines, LIVE) == [0, 1, 2]

        # s: by state (the unregistered rank before the live ones), then by heartbeat age, then by plans.
        watch.send("s")
        frame = watch.frame(lambda ls: status_line(ls).startswith("sort: state"), "the sort by state")
        assert rank_order(rows_of(frame), LIVE) == [2, 0, 1]
        watch.send("ss")
        frame = watch.frame(lambda ls: status_line(ls).startswith("sort: plans"), "the sort by plans")
        assert rank_order(rows_of(frame), LIVE) == [2, 1, 0]  # 0, 1 and 3 plans.
        watch.send("s")
        watch.frame(lambda ls: status_line(ls).startswith("sort: rank"), "the sort back to rank")

        # f: the filter being typed shows on the key line; Enter applies it.
        watch.send("f")
        watch.frame(lambda ls: ls[-1].startswith("filter: job id starts with: _"), "the filter prompt")
        watch.send("zz\r")
        frame = watch.frame(lambda ls: "filter: job id zz*" in status_line(ls), "the filter applied")
        lines = check_fits(frame, 24, 80)
        assert any(line.startswith("JOB " + LIVE) for line in lines)
        assert not any(FINISHED in line or FINISHED_SHORT in line for line in lines), "\n".join(lines)
        # A filter that matches a finished job shows it in full, with its ranks; Esc clears it.
        watch.send("/aa\r")
        frame = watch.frame(lambda ls: "filter: job id aa*" in status_line(ls), "the filter on the finished job")
        lines = rows_of(frame)
        assert rank_order(lines, FINISHED) == [0, 1] and not any(LIVE in line for line in lines), "\n".join(lines)
        watch.send("\x1b")
        frame = watch.frame(lambda ls: "filter: all jobs" in status_line(ls), "the filter cleared")
        assert any(line.startswith("JOB " + FINISHED) for line in rows_of(frame))

        # h: the help overlay names the keys; h again closes it.
        watch.send("h")
        frame = watch.frame(lambda ls: any("sort the rank tables" in line for line in ls), "the help")
        check_fits(frame, 24, 80)
        watch.send("h")
        watch.frame(lambda ls: status_line(ls).startswith("sort: "), "the help closed")

        # A smaller terminal: SIGWINCH redraws at once, within 12 rows (the header, the status
        # line and the key line stay; 9 rows of body scroll).
        watch.mark = len(watch.raw)
        watch.resize(12, 60)
        frame = watch.frame(lambda ls: len(ls) == 12, "a frame of 12 rows")
        lines = check_fits(frame, 12, 60)
        total = int(re.search(r"rows 1-9 of (\d+)", status_line(lines)).group(1))
        bottom = total - 9
        assert bottom > 1, status_line(lines)

        def at(first):
            return lambda ls: f"rows {first + 1}-{first + 9} of {total}" in status_line(ls)
        watch.send("j")
        watch.frame(at(1), "a line down")
        watch.send("\x1b[6~")  # PgDn
        watch.frame(at(min(10, bottom)), "a page down")
        watch.send("\x1b[H")  # Home
        watch.frame(at(0), "the top")
        watch.send("\x1b[F")  # End: the finished jobs at the bottom.
        frame = watch.frame(at(bottom), "the bottom")
        assert rows_of(frame)[-2].startswith("JOB " + FINISHED_SHORT), "\n".join(rows_of(frame))
        watch.send("\x1b[A")  # Up
        watch.frame(at(bottom - 1), "a line up")
        watch.mark = len(watch.raw)
        watch.resize(24, 80)
        watch.frame(lambda ls: len(ls[-1]) == 80 and f"rows 1-{total} of {total}" in status_line(ls),
                    "a frame of 80 columns with the whole body again")

        # r: fetches at once (the interval is an hour): rank 2 registers and shows live.
        with worker(daemon, LIVE, 2, 3):
            wait_for(lambda: shardctl_json(daemon, "status", "--job", LIVE)["jobs"][0].get("ranks_live") == 3, WAIT,
                     "rank 2 to register")
            watch.send("r")
            frame = watch.frame(lambda ls: any(line.startswith("JOB " + LIVE + "  ranks 3 live") for line in ls),
                                "the refreshed frame")
            check_fits(frame, 24, 80)
            watch.send("q")
            assert watch.wait_exit() == 0
        assert watch.raw.endswith("\x1b[?25h\x1b[?1049l"), "the terminal is given back: " + repr(watch.raw[-40:])
    finally:
        watch.close()
        w0.close()
        w1.close()


def test_watch_without_colour_when_no_color_is_set(daemon, wait_for):
    finish_jobs(daemon, wait_for)
    watch = Watch(daemon.address, env={"NO_COLOR": "1"})
    try:
        frame = watch.frame(lambda ls: any(line.startswith("JOB " + FINISHED) for line in ls), "the finished job")
        assert not SGR.search(frame), repr(frame)
        check_fits(frame, 24, 80)
        watch.send("q")
        assert watch.wait_exit() == 0
    finally:
        watch.close()


def test_shardctl_ranks_columns_stay_under_their_headers_with_long_job_ids(daemon, wait_for):
    finish_jobs(daemon, wait_for)
    out = subprocess.run([os.environ["SHARDCTL"], "ranks", "--coordinator", daemon.address], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert len(rows) == 3, out.stdout
    # Numbers are right-aligned under RANK, the state starts under STATE: the same column in every row.
    rank_end, state_at = header.index("RANK") + len("RANK"), header.index("STATE")
    for row in rows:
        assert row[:rank_end].rstrip().split()[-1].isdigit() and row[rank_end] == " ", out.stdout
        assert row[state_at:].startswith("left"), out.stdout
