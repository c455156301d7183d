"""A coordinator for one job when none is given: with no ``address`` and no ``$SHARDCOORD_ADDR``,
global rank 0 starts a ``shardcoordd`` for the job and hands its address to the other ranks through
the rendezvous store the launcher already runs (torch.distributed's default store once
``init_process_group`` ran; torchrun's agent store before that), and the daemon stops with rank 0.

On one host it listens on 127.0.0.1. Across hosts it listens on every interface with a rank token
it made (shared through the store, which every rank of the job already trusts) and without TLS:
the log says so; a production job (several jobs, restart survival, TLS) runs the standalone
daemon and sets ``$SHARDCOORD_ADDR`` (README, "Python"). ``$SHARDCOORD_EMBEDDED=0`` refuses the
embedded mode instead (a missing address is then an error)."""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Tuple

from .errors import FailedPrecondition, InvalidArgument, Unavailable

EMBEDDED_ENV = "SHARDCOORD_EMBEDDED"
START_TIMEOUT = 30.0  # Seconds for rank 0's daemon to serve, and for the others to hear of it.
_KEY = "shardcoord/embedded/{job}"
_started: dict = {}  # job id -> (process, address, token): one daemon per job and process.


def _store(timeout: float) -> Any:
    """The rendezvous store of this launch, or None: torch.distributed's default store, else
    torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``) at MASTER_ADDR:MASTER_PORT."""
    try:
        import torch.distributed as dist
    except Exception:  # noqa: BLE001 - no torch: no store
        return None
    if dist.is_available() and dist.is_initialized():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - a backend without one
            pass
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        import datetime

        return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=timeout))
    return None


def _one_host(world: int) -> bool:
    """Whether every rank runs on this host (the launcher says so, or the rendezvous is local)."""
    env = os.environ
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(env["LOCAL_WORLD_SIZE"]) == world
    if env.get("SLURM_NNODES", "").isdigit():
        return int(env["SLURM_NNODES"]) == 1
    return env.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost", "::1")


def _advertised_host() -> str:
    """This host's address as the other hosts reach it: the interface that routes to MASTER_ADDR."""
    target = os.environ.get("MASTER_ADDR", "")
    if target:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))  # No packet is sent: this only picks the route.
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def _die_with_parent() -> None:
    """In the daemon's child before exec: SIGTERM when rank 0's process ends, whatever the cause."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; atexit stops it too
        pass


def _start(job_id: str, one_host: bool) -> Tuple[Any, str, str]:
    from ._cli import binary, environment

    path = binary("shardcoordd")
    if path is None:
        raise FailedPrecondition(
            "shardcoord: no coordinator address ($SHARDCOORD_ADDR, or address=) and no shardcoordd to start one for "
            "this job: this installation lacks the daemon; install shardcoord with pip from a checkout (it ships "
            "shardcoordd) or the .deb, or start a shardcoordd and set $SHARDCOORD_ADDR=host:port")
    folder = Path(tempfile.mkdtemp(prefix="shardcoord-embedded-"))
    token = "" if one_host else secrets.token_hex(16)
    argv = [path, "--listen", "127.0.0.1:0" if one_host else "0.0.0.0:0", "--address-file", str(folder / "addr")]
    if token:
        (folder / "tokens").write_text(f"rank {token}\n")
        os.chmod(folder / "tokens", 0o600)
        argv += ["--token-file", str(folder / "tokens"), "--insecure"]
    log = open(folder / "shardcoordd.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=environment(),
                            preexec_fn=_die_with_parent)
    log.close()
    deadline = time.monotonic() + START_TIMEOUT
    addr_file = folder / "addr"
    while not (addr_file.exists() and ":" in addr_file.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise Unavailable(f"shardcoord: the embedded shardcoordd did not start within {START_TIMEOUT:.0f} s "
                              f"(exit {proc.poll()}): {(folder / 'shardcoordd.log').read_text()[-600:]}")
        time.sleep(0.02)
    port = addr_file.read_text().strip().rsplit(":", 1)[1]
    address = f"127.0.0.1:{port}" if one_host else f"{_advertised_host()}:{port}"

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    atexit.register(stop)
    how = "on 127.0.0.1 (every rank on this host)" if one_host else \
        "on every interface with a rank token it made, without TLS (ranks on several hosts)"
    print(f"shardcoord: job '{job_id}': no coordinator address given ($SHARDCOORD_ADDR), so rank 0 started an "
          f"embedded shardcoordd for this job at {address}, {how}; it stops with rank 0 (log: {folder}/shardcoordd.log; "
          f"shardctl --coordinator {address} status). For several jobs, restarts and TLS, run the standalone daemon "
          f"and set $SHARDCOORD_ADDR", file=sys.stderr, flush=True)
    return proc, address, token


def coordinator_for(job_id: str, rank: int, world: int, timeout: float = START_TIMEOUT) -> Tuple[str, str]:
    """(address, token) of this job's embedded coordinator: started here on rank 0, read from the
    rendezvous store elsewhere. InvalidArgument when the embedded mode is off or impossible."""
    if os.environ.get(EMBEDDED_ENV, "1") == "0":
        raise InvalidArgument("shardcoord: no coordinator address: set $SHARDCOORD_ADDR=host:port or pass address= "
                              f"(${EMBEDDED_ENV}=0 turned off the embedded daemon)")
    if job_id in _started:
        _, address, token = _started[job_id]
        return address, token
    store = _store(timeout) if world > 1 else None
    if world > 1 and store is None:
        raise InvalidArgument(
            "shardcoord: no coordinator address ($SHARDCOORD_ADDR, or address=), and no rendezvous store to share "
            "an embedded one through: launch with torchrun, or call torch.distributed.init_process_group before "
            "creating the Worker, or set $SHARDCOORD_ADDR to a running shardcoordd")
    key = _KEY.format(job=job_id)
    if rank == 0:
        proc, address, token = _start(job_id, _one_host(world))
        _started[job_id] = (proc, address, token)
        if store is not None:
            store.set(key, f"{address}\n{token}")
        return address, token
    try:
        store.wait([key], __import__("datetime").timedelta(seconds=timeout))
        address, token = store.get(key).decode().split("\n", 1)
    except Exception as e:  # noqa: BLE001 - the store's timeout or a lost rank 0
        raise Unavailable(f"shardcoord: rank {rank} waited {timeout:.0f} s for rank 0's embedded shardcoordd "
                          f"(key '{key}' in the rendezvous store): {e}. Is rank 0 running, and did it create its "
                          f"Worker with the same job id?") from None
    return address, token


def started(job_id: str) -> Optional[str]:
    """The address of the embedded daemon this process started for ``job_id``, or None."""
    entry = _started.get(job_id)
    return entry[1] if entry else None
