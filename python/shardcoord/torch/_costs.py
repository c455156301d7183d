"""CostMeter: what the controlled modules cost on this rank, measured where the trainer runs them,
for the coordinator's cost-aware ``auto`` (``Worker.report_costs``) and for calibration files.

    ctl = fsdp2.shard(model, specs)            # or ex = shardcoord.torch.Executor(model, specs, ...)
    meter = sct.CostMeter.attach(model, specs) # after the executor / fsdp2.shard: see below
    for step, mb, batch, decision in plans:
        meter.next_microbatch()                # reads the timings of earlier microbatches, never waits
        ...                                    # begin_microbatch, forward, backward, end_microbatch
        if mb == accum - 1:
            meter.end_step()                   # a memory sample at the step's peak
            meter.report(worker)               # Worker.report_costs, where the worker has it

What it measures, per controlled module of the manifest:

- **forward seconds per call**: from the module's first forward pre-hook to its last forward hook,
  less the gathers measured inside the call (below), so it is the module's compute under every
  decision. CUDA events on the current stream when the module's parameters are on a GPU (read
  lazily: :meth:`next_microbatch` and :meth:`costs` take only events that have completed, so no
  synchronization is added to the training loop), ``time.perf_counter`` otherwise.
- **per unit, gather seconds and bytes**, for units that something gathers: an FSDP2 unit
  (``fully_shard``: ``shardcoord.fsdp2``) or a unit the plain executor materializes in its forward
  pre-hook. Two kinds of sample: an explicit ``unshard()`` of an FSDP2 unit (what ``root`` and the
  making of a replica call: the whole all-gather, on the current stream) and, otherwise, the time
  between the unit's first and last forward pre-hooks (FSDP2's pre-forward unshard and wait, or the
  executor's all-gather: what ``per_layer`` exposes, less when a prefetch hid it). A unit reports
  the median of its explicit gathers when it has any, else of its pre-forward ones. Gather bytes
  are the unit's ``param_bytes`` in the manifest (one all-gather's output, before padding).
- **memory**: at :meth:`end_step`, free device memory at the peak, ``mem_get_info`` free +
  ``memory_reserved`` - ``max_memory_allocated`` (that is total - peak, less what other processes
  and the CUDA context hold), and the bytes the controlled modules' parameters held then. The
  peak is ``max_memory_allocated`` since its last reset (the meter resets it at each
  ``end_step`` only with ``reset_peak=True``: a trainer that reads it itself keeps it).

Each estimate is the median of the last ``window`` samples (robust to a slow first call or a
hiccup). Hooks are registered so that they enclose the executor's and FSDP2's own: attach
*after* ``Executor(...)`` / ``fsdp2.shard(...)``. Not thread-safe: the training loop drives it.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

#: ``(module, forward_seconds_per_call, [(unit, gather_bytes, gather_seconds), ...])``
ModuleCosts = Tuple[str, float, List[Tuple[str, int, float]]]


class _Clock:
    """Stamps on the module's device: CUDA events, or perf_counter floats (``clock`` overrides)."""

    def __init__(self, device: Any, clock: Optional[Callable[[], float]]):
        self.device = device if device is not None and getattr(device, "type", "") == "cuda" else None
        self.clock = clock or time.perf_counter

    def stamp(self) -> Any:
        if self.device is None:
            return self.clock()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def ready(stamp: Any) -> bool:
        return not hasattr(stamp, "query") or stamp.query()

    @staticmethod
    def seconds(start: Any, end: Any) -> float:
        if hasattr(start, "elapsed_time"):
            return max(start.elapsed_time(end) / 1000.0, 0.0)
        return max(float(end - start), 0.0)


class _Unit:
    def __init__(self, name: str, gather_bytes: int, window: int):
        self.name = name
        self.gather_bytes = gather_bytes
        self.explicit: Deque[float] = collections.deque(maxlen=window)  # Whole unshard() calls.
        self.exposed: Deque[float] = collections.deque(maxlen=window)   # Pre-forward hooks.
        self.open: Optional[Any] = None

    def seconds(self) -> Optional[float]:
        samples = self.explicit or self.exposed
        return statistics.median(samples) if samples else None


class _Call:
    """One forward call of a module: its stamps and the gathers inside it."""

    __slots__ = ("start", "end", "gathers")

    def __init__(self, start: Any):
        self.start, self.end, self.gathers = start, None, []


class _Module:
    def __init__(self, name: str, clock: _Clock, window: int):
        self.name = name
        self.clock = clock
        self.units: Dict[str, _Unit] = {}
        self.forward: Deque[float] = collections.deque(maxlen=window)
        self.calls = 0
        self.stack: List[_Call] = []  # Open calls (a module may call itself; rare).


def _param_bytes(module: Any) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _device_of(module: Any) -> Any:
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # An FSDP2 DTensor: its shard's device.
        return local.device
    return None


def _is_fsdp_unit(module: Any) -> bool:
    return callable(getattr(module, "unshard", None)) and callable(getattr(module, "reshard", None))


def _is_unsharded(module: Any) -> bool:
    """Whether an FSDP2 unit is gathered now (its unshard() would be a no-op); False if unknown."""
    state = getattr(module, "_get_fsdp_state", None)
    try:
        group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
    except Exception:  # pragma: no cover - several parameter groups on a newer torch
        return False
    return bool(getattr(group, "is_unsharded", False))


def _prepend_pre_hook(module: Any, hook: Callable) -> Any:
    """A forward pre-hook that runs before the ones already registered (torch 1.13 has no prepend=)."""
    try:
        return module.register_forward_pre_hook(hook, prepend=True)
    except TypeError:
        handle = module.register_forward_pre_hook(hook)
        module._forward_pre_hooks.move_to_end(handle.id, last=False)
        return handle


class CostMeter:
    """Measures the controlled modules' costs on this rank (the module docstring says how).

    ``window``: samples kept per estimate (the median of the last ``window``). ``clock``: the
    seconds clock for modules not on a GPU (default ``time.perf_counter``; tests pass their own).
    ``reset_peak``: :meth:`end_step` resets ``max_memory_allocated`` after reading it.
    ``held_outside``: bytes the controlled modules hold outside the model (``shardcoord.fsdp2``'s
    replicas: pass ``ctl.held_outside_bytes``), counted as held: without it a rank holding a
    replica measures its room one tower too low, and ``auto`` demotes the replica it just made."""

    def __init__(self, window: int = 32, clock: Optional[Callable[[], float]] = None, reset_peak: bool = False,
                 held_outside: Optional[Callable[[], int]] = None):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._clock = clock
        self._reset_peak = reset_peak
        self._held_outside = held_outside
        self._modules: Dict[str, _Module] = {}
        self._pending: Deque[Tuple[str, Any, Any, Any]] = collections.deque()  # (kind, target, start, end)
        self._handles: List[Any] = []
        self._wrapped: List[Tuple[Any, Any]] = []  # FSDP2 units whose unshard() is wrapped, what it was.
        self._memory: Deque[Tuple[int, int]] = collections.deque(maxlen=window)  # (headroom, held)
        self._device: Any = None
        self._module_refs: List[Any] = []

    @classmethod
    def attach(cls, model: Any, manifest: Sequence[Any], **kwargs: Any) -> "CostMeter":
        """A meter hooked onto ``model``'s controlled modules: ``manifest`` as given to the executor
        or ``fsdp2.shard`` (entries with ``name`` and ``units``; a plain module path works too).
        Attach after the executor or ``fsdp2.shard``, so its hooks enclose theirs."""
        meter = cls(**kwargs)
        for spec in manifest:
            meter._attach_module(model, spec)
        return meter

    def detach(self) -> None:
        """Removes the hooks and the wrappers (what was measured stays readable)."""
        for handle in self._handles:
            handle.remove()
        for unit, before in reversed(self._wrapped):
            if before is None:
                unit.__dict__.pop("unshard", None)
            else:
                unit.unshard = before  # Another meter's wrapper, attached before this one.
        self._handles, self._wrapped = [], []

    # -- hooks

    def _attach_module(self, model: Any, spec: Any) -> None:
        name = spec if isinstance(spec, str) else spec.name
        module = model.get_submodule(name)
        device = _device_of(module)
        if self._device is None and getattr(device, "type", "") == "cuda":
            self._device = device
        track = _Module(name, _Clock(device, self._clock), self.window)
        self._modules[name] = track
        self._module_refs.append(module)
        units = [] if isinstance(spec, str) else list(spec.units)
        rest = next((u for u in units if u.name == ""), None)
        # The module's own pre-hooks (the executor's rest unit) are a gather too, when it has any.
        gathers_rest = rest is not None and len(module._forward_pre_hooks) > 0 and not _is_fsdp_unit(module)
        unit = self._new_unit(track, "", getattr(rest, "param_bytes", 0)) if gathers_rest else None
        for u in units:
            if u.name:
                sub = module.get_submodule(u.name)
                self._attach_unit(track, u.name, sub, getattr(u, "param_bytes", None) or _param_bytes(sub))
        self._handles.append(_prepend_pre_hook(module, lambda m, a: self._module_start(track, unit)))
        if unit is not None:
            self._handles.append(module.register_forward_pre_hook(lambda m, a: self._unit_close(track, unit)))
        self._handles.append(module.register_forward_hook(lambda m, a, o: self._module_end(track)))

    def _new_unit(self, track: _Module, name: str, gather_bytes: int) -> _Unit:
        unit = _Unit(name, int(gather_bytes), self.window)
        track.units[name] = unit
        return unit

    def _attach_unit(self, track: _Module, name: str, module: Any, gather_bytes: int) -> None:
        fsdp = _is_fsdp_unit(module)
        if not fsdp and len(module._forward_pre_hooks) == 0:
            return  # Nothing gathers it (a plain, unsharded model): no gather to measure.
        unit = self._new_unit(track, name, gather_bytes)
        self._handles.append(_prepend_pre_hook(module, lambda m, a: self._unit_open(track, unit)))
        self._handles.append(module.register_forward_pre_hook(lambda m, a: self._unit_close(track, unit)))
        if fsdp:
            self._wrap_unshard(track, unit, module)

    def _wrap_unshard(self, track: _Module, unit: _Unit, module: Any) -> None:
        original = module.unshard

        def unshard(*args: Any, **kwargs: Any) -> Any:
            async_op = kwargs.get("async_op", args[0] if args else False)
            if async_op or _is_unsharded(module):
                return original(*args, **kwargs)  # A handle to wait on later, or a no-op: not timed.
            start = track.clock.stamp()
            result = original(*args, **kwargs)
            self._add_gather(track, unit, "explicit", start, track.clock.stamp())
            return result

        self._wrapped.append((module, module.__dict__.get("unshard")))  # Restored by detach().
        module.unshard = unshard

    def _module_start(self, track: _Module, rest: Optional[_Unit]) -> None:
        self._drain()
        track.calls += 1
        call = _Call(track.clock.stamp())
        track.stack.append(call)
        if rest is not None:
            rest.open = call.start

    def _module_end(self, track: _Module) -> None:
        if not track.stack:
            return
        call = track.stack.pop()
        call.end = track.clock.stamp()
        self._pending.append(("forward", track, call, None))

    def _unit_open(self, track: _Module, unit: _Unit) -> None:
        unit.open = track.clock.stamp()

    def _unit_close(self, track: _Module, unit: _Unit) -> None:
        if unit.open is not None:
            self._add_gather(track, unit, "exposed", unit.open, track.clock.stamp())
            unit.open = None

    def _add_gather(self, track: _Module, unit: _Unit, kind: str, start: Any, end: Any) -> None:
        if track.stack:
            track.stack[-1].gathers.append((start, end))  # Not the module's compute.
        self._pending.append((kind, unit, start, end))
        if len(self._pending) > 4096:  # A rank that gathers but never runs the module, nor reads.
            self._drain()

    # -- reading

    def _drain(self) -> None:
        """Turns completed stamps into samples, oldest first; stops at the first not completed."""
        while self._pending:
            kind, target, start, end = self._pending[0]
            last = start.end if kind == "forward" else end
            if not _Clock.ready(last):
                return
            self._pending.popleft()
            if kind == "forward":
                gathers = sum(_Clock.seconds(a, b) for a, b in start.gathers)
                target.forward.append(max(_Clock.seconds(start.start, start.end) - gathers, 0.0))
            else:
                (target.explicit if kind == "explicit" else target.exposed).append(_Clock.seconds(start, end))

    def next_microbatch(self) -> None:
        """At the start of a microbatch: reads what has completed (never waits) and forgets calls a
        failed forward left open."""
        for track in self._modules.values():
            track.stack.clear()
            for unit in track.units.values():
                unit.open = None
        self._drain()

    def end_step(self) -> None:
        """After a step (optimizer included): a memory sample at the step's peak. Reads the device's
        memory counters (no synchronization); nothing on CPU."""
        if self._device is None:
            return
        import torch

        self._memory.append(self._memory_now())
        if self._reset_peak:
            torch.cuda.reset_peak_memory_stats(self._device)

    def _memory_now(self) -> Tuple[int, int]:
        """(free bytes at the peak so far, bytes the controlled modules' parameters hold now)."""
        import torch

        free, _total = torch.cuda.mem_get_info(self._device)
        headroom = free + torch.cuda.memory_reserved(self._device) - torch.cuda.max_memory_allocated(self._device)
        return max(int(headroom), 0), self._held_bytes()

    def _held_bytes(self) -> int:
        """Bytes of the controlled modules' parameter storage on this rank now, each storage once
        (an FSDP2 shard's, or the gathered unit's), plus ``held_outside()`` (a replica that
        ``shardcoord.fsdp2`` keeps outside the model)."""
        seen: Dict[int, int] = {}
        for module in self._module_refs:
            for p in module.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                try:
                    storage = local.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
                except (AttributeError, RuntimeError):  # pragma: no cover - an older torch
                    seen[id(local)] = local.numel() * local.element_size()
        return sum(seen.values()) + (int(self._held_outside()) if self._held_outside else 0)

    def calls(self, module: str) -> int:
        """Forward calls of ``module`` seen so far."""
        return self._modules[module].calls

    def costs(self) -> List[ModuleCosts]:
        """``(module, forward_seconds_per_call, [(unit, gather_bytes, gather_seconds), ...])`` per
        controlled module, in manifest order: medians of the last ``window`` samples of what has
        completed. Forward seconds are 0.0 until the module ran on this rank; units without a
        sample (or that nothing gathers) are absent. Never waits."""
        self._drain()
        out = []
        for name, track in self._modules.items():
            forward = statistics.median(track.forward) if track.forward else 0.0
            units = [(u.name, u.gather_bytes, u.seconds()) for u in track.units.values() if u.seconds() is not None]
            out.append((name, float(forward), [(n, int(b), float(s)) for n, b, s in units]))
        return out

    def headroom_bytes(self) -> int:
        """Free device memory at the step's peak (the smallest of the last ``window`` end_step
        samples; the current value before the first); -1 on CPU."""
        if self._device is None:
            return -1
        return min(h for h, _ in self._memory) if self._memory else self._memory_now()[0]

    def frozen_budget_bytes(self) -> int:
        """Bytes the frozen modules may hold at once here: free memory at the peak plus what their
        parameters held then (smallest of the last samples); 0 when not measured (CPU)."""
        if self._device is None:
            return 0
        return min(h + held for h, held in (self._memory or [self._memory_now()]))

    def report(self, worker: Any) -> bool:
        """``worker.report_costs(costs(), frozen_budget_bytes())`` when the worker has ``report_costs``
        (the binding's Worker does from 0.2); False, doing nothing, when it has not."""
        report_costs = getattr(worker, "report_costs", None)
        if report_costs is None:
            return False
        report_costs(self.costs(), self.frozen_budget_bytes())
        return True
