"""Plans kept ahead of the training loop: with_keys numbers a loader's microbatches, PlanAhead
reports their plans ``lookahead`` microbatches before the loop asks for their decisions."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, TypeVar

from ..errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from ..worker import Decision, Worker

T = TypeVar("T")


def with_keys(batches: Iterable[T], accum: int, start_step: int = 0) -> Iterator[Tuple[int, int, T]]:
    """``(step, microbatch, batch)`` for a plain iterable of microbatches, ``accum`` per step."""
    if accum < 1:
        raise InvalidArgument(f"accum must be >= 1, got {accum}")
    for i, batch in enumerate(batches):
        yield start_step + i // accum, i % accum, batch


class PlanAhead(Iterator[Tuple[int, int, T, "Decision"]]):  # The bound Decision is looked up on first use.
    """Keeps this rank's plans reported ``lookahead`` microbatches ahead of the training loop, so that
    decisions are normally made before the loop asks (the wait is then a queue pop).

    ``batches`` yields ``(step, microbatch, batch)`` in increasing key order (see :func:`with_keys`);
    ``plan_fn(batch)`` says how often each controlled module runs on it (``{module: calls}``).
    Iterating yields ``(step, microbatch, batch, decision)``, the decision being the group's,
    waited for at most ``timeout`` seconds. ``lookahead`` (default: the group's, as registered)
    counts the microbatch being returned, as the C++ ``shardcoord::PlanAhead``; batches are pulled
    from ``batches`` that far ahead. Errors are the worker's, unchanged (shardcoord.Error). Not
    thread-safe: one training loop drives it.

    :attr:`plan` is the plan reported for the microbatch returned last: give it to the executor
    (``begin_microbatch(decision, calls=plans.plan)``) rather than calling ``plan_fn`` again, so
    the calls it pads and releases by are exactly those the group decided on.
    """

    def __init__(self, worker: Worker, batches: Iterable[Tuple[int, int, T]],
                 plan_fn: Callable[[T], Mapping[str, int]], lookahead: Optional[int] = None, timeout: float = 60.0):
        window = worker.group.lookahead
        lookahead = window if not lookahead else lookahead
        if not 1 <= lookahead <= window:
            raise InvalidArgument(f"lookahead {lookahead} must be in 1..{window} (the group's lookahead window, "
                                  f"as registered)")
        if timeout < 0:
            raise InvalidArgument(f"timeout must be >= 0 seconds, got {timeout}")
        self.lookahead = lookahead
        self.timeout = timeout
        self._worker = worker
        self._source = iter(batches)
        self._plan_fn = plan_fn
        self._pending: Deque[Tuple[int, int, T, Dict[str, int]]] = collections.deque()
        self._exhausted = False
        self.reported = 0  # Plans reported so far.
        self.key: Optional[Tuple[int, int]] = None  # The key returned last.
        self.plan: Dict[str, int] = {}  # The plan reported for it.

    @property
    def pending(self) -> List[Tuple[int, int]]:
        """Keys reported and not yet returned, oldest first."""
        return [(s, m) for s, m, _, _ in self._pending]

    def _fill(self) -> None:
        while not self._exhausted and len(self._pending) < self.lookahead:
            try:
                item = next(self._source)
            except StopIteration:
                self._exhausted = True
                return
            try:
                step, microbatch, batch = item
            except (TypeError, ValueError):
                what = f"a {type(item).__name__} of {len(item)} items" if isinstance(item, (tuple, list)) \
                    else f"a {type(item).__name__}"
                raise InvalidArgument(f"PlanAhead: batches must yield (step, microbatch, batch) tuples of 3 items, "
                                      f"got {what}; wrap a plain loader with with_keys(loader, accum)") from None
            plan = dict(self._plan_fn(batch))  # A copy: what was reported, whatever plan_fn keeps.
            self._worker.report_plan(step, microbatch, plan)
            self._pending.append((step, microbatch, batch, plan))
            self.reported += 1

    def __iter__(self) -> "PlanAhead[T]":
        return self

    def __next__(self) -> Tuple[int, int, T, Decision]:
        self._fill()
        if not self._pending:
            raise StopIteration
        step, microbatch, batch, self.plan = self._pending.popleft()
        self.key = (step, microbatch)
        return step, microbatch, batch, self._worker.get_decision(step, microbatch, self.timeout)

