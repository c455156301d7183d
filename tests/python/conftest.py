"""Fixtures for the Python tests: a real shardcoordd on 127.0.0.1 with a port it picks.

ctest sets SHARDCOORDD (the daemon binary) and PYTHONPATH (the build tree's python/ folder)."""

import os
import subprocess
import time

import pytest


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def stop_process(proc, grace):
    """SIGTERM, then SIGKILL if it is still running after `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Daemon:
    """`listen` 127.0.0.1:0 picks a port; a restart passes the address of the daemon it replaces."""

    def __init__(self, tmp_path, *flags, listen="127.0.0.1:0", name="daemon"):
        binary = os.environ.get("SHARDCOORDD")
        if not binary:
            pytest.fail("SHARDCOORDD is not set: run these tests through ctest")
        self.addr_file = tmp_path / (name + ".addr")
        self.err = open(tmp_path / (name + ".err"), "w")
        self.proc = subprocess.Popen([binary, "--listen", listen, "--address-file", str(self.addr_file),
                                      *flags], stdout=subprocess.DEVNULL, stderr=self.err)
        _wait_for(lambda: self.addr_file.exists() and ":" in self.addr_file.read_text() or self.proc.poll() is not None,
                  20, "shardcoordd to write its address")
        if self.proc.poll() is not None:
            raise AssertionError(f"shardcoordd exited: {(tmp_path / (name + '.err')).read_text()}")
        self.address = self.addr_file.read_text().strip()

    def stop(self):
        stop_process(self.proc, grace=10)
        self.err.close()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path, "--heartbeat-interval-ms", "100", "--heartbeat-timeout-ms", "1500")
    yield d
    d.stop()


@pytest.fixture
def trainer_daemon(tmp_path):
    """For tests with several torch rank processes (as the C++ trainer tests): heartbeats every
    200 ms, a rank silent for 5 s is dead, so that a loaded 2-core machine cannot starve a live
    rank into a false death."""
    d = Daemon(tmp_path, "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "5000")
    yield d
    d.stop()


@pytest.fixture
def wait_for():
    return _wait_for
