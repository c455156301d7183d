"""Failures of ``torch.distributed`` collectives, named by the coordinator: a collective of your own
that fails or hangs raises the coordinator's verdict (which rank died, and why) instead of the
backend's error or timeout; FailureWatch aborts the process groups that shardcoord does not drive
(FSDP2's) once a peer is declared dead."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from ..errors import Error, GroupFailed, InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from ..worker import Worker


def collective_failure(worker: Optional[Worker], what: str, cause: BaseException, wait: float = 2.0) -> Error:
    """The error to raise for a failed ``torch.distributed`` collective.

    A peer's socket closing usually means the peer died; the coordinator sees its session end at
    the same moment and fails its group, naming the rank, and tells the job's other groups. This
    waits up to ``wait`` seconds for that verdict (``worker.job_health()``: this rank's group, or a
    rank lost in another group, which a collective over the world also includes) and returns it
    (GroupFailed: "... rank 1 declared dead ..."), or GroupFailed with the collective's own error
    when none comes."""
    if worker is not None:
        deadline = time.monotonic() + wait
        while True:
            try:
                worker.job_health()
            except Error as verdict:
                return verdict
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
    return GroupFailed(f"{what} failed: {cause}")


@contextlib.contextmanager
def collective(worker: Optional[Worker], what: str, wait: float = 2.0) -> Iterator[None]:
    """``with collective(worker, "gradient all-reduce"): dist.all_reduce(t)``: a RuntimeError from
    the collective becomes :func:`collective_failure`'s shardcoord error (chained to it)."""
    try:
        yield
    except Error:
        raise
    except RuntimeError as e:
        raise collective_failure(worker, what, e, wait) from e


def wait_collective(work: Any, worker: Optional[Worker], what: str, *, poll: float = 0.05,
                    verdict_wait: float = 2.0) -> None:
    """Waits for an asynchronous collective (``dist.all_reduce(t, async_op=True)``) while watching
    the coordinator: once this rank's group failed, or a rank of another group of the job was
    declared dead (also one that hangs without closing its sockets, after the heartbeat timeout:
    a world collective waits for it too), the verdict is raised at once,
    instead of after the backend's own timeout; a collective that fails raises
    :func:`collective_failure`'s error. The abandoned operation must not be waited for again:
    the process group is unusable (exit, or build a new one)."""
    import datetime

    if worker is None:
        with collective(None, what, verdict_wait):
            work.wait()
        return
    interval = datetime.timedelta(seconds=poll)
    while True:
        try:
            work.wait(interval)
            return
        except RuntimeError:  # "Operation timed out!" (the poll) or the collective's failure.
            if work.is_completed():
                # Completed: but maybe just after the poll timed out (the poll's "Operation timed
                # out!" is no failure; taking it for one failed a healthy job on a loaded host,
                # issue 25). Its own outcome decides: waiting again returns at once.
                with collective(worker, what, verdict_wait):
                    work.wait()
                return
        worker.job_health()  # Raises the coordinator's verdict (GroupFailed names the rank).


def abort_process_group(pg: Any = None) -> bool:
    """Aborts a ``torch.distributed`` process group (``None``: the default one) so that collectives
    blocked in it return (NCCL kernels watch the communicator's abort flag). Returns False when this
    torch or backend cannot abort (torch 1.13, Gloo: a dead peer's closed sockets fail those)."""
    import torch
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    abort = getattr(c10d, "_abort_process_group", None)  # torch >= 2.6
    if abort is not None:
        abort(pg)
        return True
    group = pg if pg is not None else c10d._get_default_group()
    for device in ("cuda", "cpu"):
        try:
            backend = group._get_backend(torch.device(device))
        except Exception:
            continue
        if hasattr(backend, "abort"):
            backend.abort()
            return True
    return False


def leave(code: int = 3) -> None:
    """Ends the process now, flushing stdout and stderr, without Python's teardown: once a peer is
    lost, destroying a Gloo process group (at exit, in its destructor) waits for that peer, which
    never answers (a stopped rank: forever). Call it after a shardcoord verdict instead of
    returning from main; NCCL groups aborted by :class:`FailureWatch` need it just as little as they
    hurt from it. The coordinator sees this rank's session end and tells its group."""
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass
    os._exit(code)


class FailureWatch:
    """Watches the coordinator from a background thread while the training loop runs collectives
    that shardcoord does not manage (FSDP2's all-gathers and reduce-scatters on NCCL).

    Once this rank's group fails (a member killed, or hung past the heartbeat timeout), or with
    ``job_wide`` (the default, right for process groups that span shard groups, such as the
    default one) once a rank of any group of the job is declared dead, the watch keeps the
    coordinator's verdict (GroupFailed, naming the rank), prints it on stderr and aborts
    ``process_groups`` (default: the default group) so that nothing stays blocked in a collective
    with the dead peer; :meth:`check`, called by the training loop once per microbatch and after
    anything that waits for the GPU, raises the verdict. Without it, a rank blocked in an NCCL
    collective waits for the process group's timeout and then dies without saying why. The
    aborted process groups are unusable afterwards: leave the process (:func:`leave`; or build new
    ones). Where a group cannot be aborted (Gloo, torch < 2.6), ``exit_after`` (seconds) ends the
    process once the loop, still blocked in a collective with the lost peer, has not taken the
    verdict that long after it came (the integrations set 10)::

        with sct.FailureWatch(worker) as watch:
            for step, mb, batch, decision in plans:
                watch.check()
                ...
                loss.item(); watch.check()
    """

    def __init__(self, worker: Worker, process_groups: Sequence[Any] = (None,), poll: float = 0.05,
                 job_wide: bool = True, exit_after: Optional[float] = None):
        if poll <= 0:
            raise InvalidArgument(f"poll must be > 0 seconds, got {poll}")
        if exit_after is not None and exit_after < 0:
            raise InvalidArgument(f"exit_after must be >= 0 seconds, got {exit_after}")
        self._exit_after = exit_after
        self._raised = threading.Event()  # The loop took the verdict (check() raised it).
        self._worker = worker
        self._groups = list(process_groups)
        self._poll = poll
        self._check = worker.job_health if job_wide else worker.health
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._abort = abort_process_group  # A seam for tests (torch 1.13 cannot abort Gloo).
        self.verdict: Optional[Error] = None
        self.aborted = False
        self.polls = 0  # Health checks made so far.

    def start(self) -> "FailureWatch":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardcoord-failure-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._raised.set()  # The loop is past its collectives: no exit_after.
        if self._thread is not None:
            self._thread.join(max(1.0, 4 * self._poll))

    def __enter__(self) -> "FailureWatch":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def check(self) -> None:
        """Raises the coordinator's verdict once the group failed; returns at once otherwise."""
        if self.verdict is not None:
            self._raised.set()
            raise self.verdict

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                self.polls += 1
                self._check()
            except Error as verdict:
                if self._stop.is_set() or getattr(self._worker, "closed", False):  # A clean end, not a failure.
                    return
                self.verdict = verdict
                print(f"shardcoord: rank {self._worker.rank}: {type(verdict).__name__}: {verdict}; aborting the "
                      f"process groups", file=sys.stderr, flush=True)
                for pg in self._groups:
                    try:
                        self.aborted = bool(self._abort(pg)) or self.aborted
                    except Exception as e:  # The verdict stands; the loop raises it at check().
                        print(f"shardcoord: aborting a process group failed: {e}", file=sys.stderr, flush=True)
                self._exit_if_stuck()
                return

    def _exit_if_stuck(self) -> None:
        """With ``exit_after``: a process group that could not be aborted (Gloo; torch < 2.6) keeps
        the loop blocked in its collective with the lost peer until the backend's own timeout (30
        minutes by default). If the loop has not taken the verdict (``check()``) ``exit_after``
        seconds after it came, the process ends here (:func:`leave`, exit code 3), the verdict
        printed: nothing else would end that wait."""
        if self._exit_after is None:
            return  # (An aborted NCCL group returns its collectives at once: the loop takes the verdict.)
        if self._raised.wait(self._exit_after) or self._stop.is_set():
            return
        print(f"shardcoord: rank {self._worker.rank}: the training loop is still blocked {self._exit_after:g} s after "
              f"the verdict, in a collective that cannot be aborted (this backend); ending the process (exit code 3)",
              file=sys.stderr, flush=True)
        leave(3)

