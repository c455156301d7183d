"""What every framework integration shares (``shardcoord.hf.TrainerMixin``, ``shardcoord.accelerate``,
``shardcoord.lightning``, a torchtitan-style loop): the manifest of a model with a clear refusal when
nothing can be controlled, the job's worker from what the launcher set, the executor for the
framework's sharding, and :class:`Microbatches`, the per-step hook::

    mbs = Microbatches(worker, control, plan_fn)      # control: fsdp2.attach(...)'s, or a torch.Executor
    for step in range(steps):
        batches = [next(loader) for _ in range(accum)]   # every microbatch of the step, before any forward
        mbs.plan(batches)                                # this rank's plans reported, keys (step, 0..accum-1)
        for batch in batches:
            with mbs.run(batch):                         # the group's decision carried out around it
                model(**batch).loss.backward()
        optimizer.step()
    mbs.close()

A training loop that fetches a step's microbatches before the first forward (HF ``Trainer``'s
``get_batch_samples``, torchtitan's ``train_step``) has its lookahead for free: the plans of the
whole step are reported at once, and each decision is normally in the worker's queue before the
microbatch's forward asks for it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from .errors import Error, FailedPrecondition, GroupFailed, InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from .worker import Decision, ModuleSpec, Worker

JOB_ENV = "SHARDCOORD_JOB"
EXIT_AFTER = 10.0  # Seconds a loop blocked in an unabortable collective has to take a verdict (FailureWatch).


def default_job_id(prefix: str = "job") -> str:
    """A job id every rank of one launch computes alike: ``$SHARDCOORD_JOB``, else torchrun's run id
    (``$TORCHELASTIC_RUN_ID``, when not the standalone ``none``), else Slurm's job and step, else
    ``<prefix>-<MASTER_ADDR>-<MASTER_PORT>`` (the rendezvous a launch uses). InvalidArgument when
    none of them is set."""
    env = os.environ
    if env.get(JOB_ENV):
        return env[JOB_ENV]
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"{prefix}-{run_id}"
    if env.get("SLURM_JOB_ID"):
        return f"{prefix}-slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{prefix}-{env['MASTER_ADDR']}-{env['MASTER_PORT']}"
    raise InvalidArgument(f"no job id: set ${JOB_ENV} (the same on every rank, e.g. the run's name) or pass "
                          f"job_id=; none of torchrun's TORCHELASTIC_RUN_ID, Slurm's SLURM_JOB_ID or "
                          f"MASTER_ADDR/MASTER_PORT is set")


def controlled_manifest(model: Any, *, extra_towers: Sequence[str] = (), extra_projectors: Sequence[str] = (),
                        layer_lists: Optional[Mapping[str, Any]] = None, trainable: Any = False,
                        who: str = "shardcoord") -> List[ModuleSpec]:
    """``shardcoord.torch.manifest(model)``, refused (FailedPrecondition) when it controls nothing,
    naming the towers and projectors it saw with trainable parameters (freeze them, or opt them in
    with ``trainable``) and the frozen modules with other names (name them in ``extra_towers``)."""
    import warnings

    from .torch import manifest
    from .torch._manifest import _frozen_roots, candidates

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # Said below, as an error.
        specs = manifest(model, layer_lists=layer_lists, extra_towers=extra_towers, extra_projectors=extra_projectors,
                         trainable=trainable)
    if specs:
        return specs
    modules = dict(model.named_modules())
    unfrozen = []
    for path, kind, frozen in candidates(modules, extra_towers, extra_projectors):
        if not frozen:
            params = list(modules[path].parameters())
            unfrozen.append(f"{kind} '{path}' ({sum(p.requires_grad for p in params)} of {len(params)} parameters "
                            f"trainable)")
    frozen = [f"'{p}'" for p, _ in _frozen_roots(model, [])[:8]]
    last = unfrozen[0].split("'")[1].rsplit(".", 1)[-1] if unfrozen else "visual"
    raise FailedPrecondition(
        f"{who}: nothing to control in {type(model).__name__}: shardcoord decides for fully frozen towers and "
        f"projectors, and for trainable ones opted in. Seen with trainable parameters: {'; '.join(unfrozen) or 'none'} "
        f"(opt them in: trainable=['{last}'] in the options, or trainable=True for every tower and projector; or "
        f"freeze them: module.requires_grad_(False), before the trainer is built); fully frozen modules with other "
        f"names: {', '.join(frozen) or 'none'} (name them with extra_towers=[...]). Without a controlled module, run "
        f"without shardcoord")


class Microbatches:
    """The per-step hook of any training loop: :meth:`plan` reports the plans of a step's
    microbatches (keys ``(step, 0..n-1)``, ``step`` counting the calls of :meth:`plan` from 0),
    :meth:`run` carries out the group's decision around one microbatch's forward and backward, in
    the order planned. ``control`` is the executor (``shardcoord.fsdp2.attach``'s control or a
    ``shardcoord.torch.Executor``: ``begin_microbatch(decision, calls)`` / ``end_microbatch()``);
    ``plan_fn(batch) -> {module: calls}`` (``shardcoord.hf.plan_fn(model)`` for the HF families).

    A ``shardcoord.torch.FailureWatch`` (``watch=True``) aborts ``process_groups`` once the
    coordinator declares a rank of the job dead, so no rank stays blocked in the framework's
    collectives; :meth:`run` raises its verdict (GroupFailed, naming the rank). :meth:`close` ends
    the worker's session, as failed with the error's text when given one. Not thread-safe."""

    def __init__(self, worker: Worker, control: Any, plan_fn: Callable[[Any], Mapping[str, int]], *,
                 timeout: float = 60.0, watch: bool = True, process_groups: Sequence[Any] = (None,),
                 log: Optional[Callable[[str], None]] = None):
        if timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout}")
        self.worker = worker
        self.control = control
        self.plan_fn = plan_fn
        self.timeout = timeout
        self.step = 0  # The key of the next plan() call.
        self.decisions: collections.Counter = collections.Counter()  # Decision kind -> microbatches x modules.
        self._pending: Deque[Tuple[Tuple[int, int], Dict[str, int], int]] = collections.deque()
        self._log = log
        self._watch = None
        if watch:
            from .torch import FailureWatch

            self._watch = FailureWatch(worker, process_groups, exit_after=EXIT_AFTER).start()
        self.closed = False

    @property
    def pending(self) -> List[Tuple[int, int]]:
        """Keys planned and not yet run, oldest first."""
        return [key for key, _, _ in self._pending]

    def plan(self, batches: Sequence[Any]) -> List[Tuple[int, int]]:
        """Reports this rank's plan for each of ``batches`` (one step's microbatches, in the order they
        will run) and returns their keys. Every plan is computed before any is reported, so a batch the
        model cannot run (``plan_fn`` raises) reports nothing. FailedPrecondition when the previous
        step's microbatches did not all run (the group would wait for them)."""
        self._check_open()
        if self._pending:
            raise FailedPrecondition(
                f"shardcoord: plan() for step {self.step} while microbatches {self.pending} of an earlier step are "
                f"planned and not run; run every planned microbatch (the group decides them on every rank alike)")
        plans = [dict(self.plan_fn(batch)) for batch in batches]
        keys = []
        for i, (batch, calls) in enumerate(zip(batches, plans)):
            self.worker.report_plan(self.step, i, calls)
            self._pending.append(((self.step, i), calls, id(batch)))
            keys.append((self.step, i))
        self.step += 1
        return keys

    @contextlib.contextmanager
    def run(self, batch: Any = None) -> Iterator[Decision]:
        """Around one planned microbatch's forward and backward (the next in plan order): waits for the
        group's decision (at most ``timeout`` seconds), has the executor carry it out, yields it, and
        ends the microbatch. ``batch``, when given, must be the object planned (a different one would
        run another plan than the group decided: InvalidArgument)."""
        self._check_open()
        if not self._pending:
            raise FailedPrecondition("shardcoord: run() with no planned microbatch; plan() the step's batches first")
        (step, mb), calls, planned_id = self._pending[0]
        if batch is not None and id(batch) != planned_id:
            raise InvalidArgument(f"shardcoord: microbatch ({step}, {mb}) runs another batch than the one planned "
                                  f"for it; run the batches in the order given to plan()")
        self._pending.popleft()
        self._check_watch()
        decision = self.worker.get_decision(step, mb, self.timeout)
        self.control.begin_microbatch(decision, calls=calls)
        try:
            yield decision
        finally:
            self.control.end_microbatch()
        self._count(decision)
        self._check_watch()

    def iterate(self, batches: Iterable[Any], per_step: int = 1) -> Iterator[Any]:
        """A loader's batches, each inside :meth:`run`: the next ``per_step`` batches are fetched and
        planned together (the step's lookahead), then yielded one by one; the microbatch ends when
        the loop asks for the next batch (after its backward), or when the loop leaves. Replace
        ``for batch in loader:`` with ``for batch in mbs.iterate(loader, accum):``."""
        if per_step < 1:
            raise InvalidArgument(f"per_step must be >= 1, got {per_step}")
        source = iter(batches)
        while True:
            step = list(itertools.islice(source, per_step))
            if not step:
                return
            self.plan(step)
            for batch in step:
                with self.run(batch):
                    yield batch

    @contextlib.contextmanager
    def run_one(self, batch: Any) -> Iterator[Decision]:
        """:meth:`plan` and :meth:`run` for a single microbatch that nothing fetched ahead (an
        evaluation batch): one round trip to the coordinator before it runs."""
        self.plan([batch])
        with self.run(batch) as decision:
            yield decision

    def _count(self, decision: Any) -> None:
        modules = getattr(decision, "modules", decision)
        for name, md in modules.items():
            kind = getattr(md, "decision", md)
            kind = kind[0] if isinstance(kind, tuple) else kind
            self.decisions[str(kind)] += 1
            if self._log is not None:
                self._log(f"shardcoord: {name}: {kind}")

    def _check_watch(self) -> None:
        if self._watch is not None:
            self._watch.check()

    def _check_open(self) -> None:
        if self.closed:
            raise FailedPrecondition("shardcoord: this job's session is closed")

    def _leave_at_exit(self, error: BaseException) -> None:
        """Training stopped on the coordinator's verdict (a peer lost): at interpreter exit, the
        process ends with exit code 3 without tearing down its process groups
        (``shardcoord.torch.leave``), whose destructors wait for the lost peer on Gloo. Other errors
        exit as Python does."""
        import atexit

        from .torch import leave

        if isinstance(error, GroupFailed) or (self._watch is not None and self._watch.verdict is not None):
            atexit.register(leave, 3)

    def close(self, error: Optional[BaseException] = None) -> None:
        """Ends the session: a clean leave, or, given the error that stopped training, a failure that
        operators and the other ranks see with its text. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._watch is not None:
            self._watch.stop()
        reason = None
        if error is not None:
            reason = f"{type(error).__name__}: {error}"
            if self._watch is not None and self._watch.verdict is not None and error is not self._watch.verdict:
                reason += f" (after the coordinator's verdict: {self._watch.verdict})"
            self._leave_at_exit(error)
        try:
            if reason is None or isinstance(error, (KeyboardInterrupt, SystemExit)):
                self.worker.close(reason=reason)
            else:
                self.worker.fail(reason)
        except Error as e:  # The session was already lost: say so, keep the training error.
            print(f"shardcoord: closing the session: {e}", file=sys.stderr, flush=True)


def plain_executor(model: Any, specs: Sequence[ModuleSpec], worker: Worker) -> Any:
    """The plain ``torch.distributed`` executor over this rank's shard group, for a model the framework
    does not shard (DDP, one process): the frozen towers' parameters are sharded now and gathered
    per decision. Hides them from DDP (``_ddp_params_and_buffers_to_ignore``), which would otherwise
    broadcast the (emptied) parameters at wrap time."""
    import torch.distributed as dist

    from .torch import Executor, shard_process_group

    pg = shard_process_group(worker) if dist.is_initialized() else None
    executor = Executor(model, specs, worker, pg)
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    for spec in specs:
        prefix = spec.name + "."
        # The sharded (frozen) ones only: a trainable tower's adapters stay DDP's to reduce.
        ignored += [prefix + n for n, p in model.get_submodule(spec.name).named_parameters() if not p.requires_grad]
    model._ddp_params_and_buffers_to_ignore = ignored
    return executor


@dataclasses.dataclass
class Options:
    """What an integration is told, each with a default that works for a Hugging Face VLM under
    torchrun (every field can be left out):

    - ``job_id``: the same on every rank (default :func:`default_job_id`); ``address``: the
      coordinator's ``host:port`` (default ``$SHARDCOORD_ADDR``).
    - ``policy`` / ``fallback``: as ``shardcoord.Worker`` (default the coordinator's, ``auto`` / ``root``).
    - ``plan_fn``: ``batch -> {module: calls}`` (default ``shardcoord.hf.plan_fn(model)`` for the
      families it knows; required for other models).
    - ``extra_towers``, ``extra_projectors``, ``layer_lists``, ``trainable``: as
      ``shardcoord.torch.manifest`` (``trainable``: towers with trainable parameters, or adapters, to
      control too: True, or their names; under FSDP2, and adapters on a frozen base under the plain
      executor).
    - ``lookahead``: the plans a rank may have undecided (default: enough for one step's microbatches).
    - ``timeout``: seconds a microbatch waits for its decision; ``root_release``,
      ``fill_missing_grads``: as ``shardcoord.fsdp2.shard``; ``worker``: further ``shardcoord.Worker``
      arguments (``token``, ``tls_ca``, ``memory_budget_bytes``, ...).
    """

    job_id: Optional[str] = None
    address: Optional[str] = None
    policy: str = ""
    fallback: str = ""
    plan_fn: Optional[Callable[[Any], Mapping[str, int]]] = None
    extra_towers: Sequence[str] = ()
    extra_projectors: Sequence[str] = ()
    layer_lists: Optional[Mapping[str, Any]] = None
    trainable: Any = False
    lookahead: int = 0
    timeout: float = 60.0
    root_release: str = "after_forward"
    fill_missing_grads: bool = True
    worker: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, options: Optional["Options"] = None, **kwargs: Any) -> "Options":
        """``options`` with ``kwargs`` set on a copy (InvalidArgument naming an unknown one)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidArgument(f"shardcoord: unknown option(s) {', '.join(unknown)}; the options are "
                                  f"{', '.join(sorted(names))}")
        return dataclasses.replace(options or cls(), **kwargs)


class Session:
    """One rank's shardcoord for a framework-driven job, in the two phases frameworks allow:
    :meth:`shard_towers` before the framework wraps the model (FSDP2: the towers' layer units; no
    FSDP: the plain executor, which is complete at once), :meth:`attach` after it (the root it made),
    then :attr:`microbatches` (:class:`Microbatches`) per step, and :meth:`close`."""

    def __init__(self, options: Optional[Options] = None, who: str = "shardcoord"):
        self.options = options or Options()
        self.who = who
        self.specs: List[ModuleSpec] = []
        self.worker: Optional[Worker] = None
        self.towers: Any = None
        self.control: Any = None
        self.plan_fn: Optional[Callable[[Any], Mapping[str, int]]] = None
        self.microbatches: Optional[Microbatches] = None

    @property
    def started(self) -> bool:
        return self.worker is not None

    def _connect(self, model: Any, group_size: int, per_step: int) -> None:
        from .worker import Worker

        o = self.options
        self.specs = controlled_manifest(model, extra_towers=o.extra_towers, extra_projectors=o.extra_projectors,
                                         layer_lists=o.layer_lists, trainable=o.trainable, who=self.who)
        self.plan_fn = o.plan_fn if o.plan_fn is not None else self._default_plan_fn(model)
        lookahead = o.lookahead or max(4, per_step)
        extra = dict(o.worker)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # The framework's process group knows the rank.
            extra.setdefault("rank", dist.get_rank())
            extra.setdefault("world_size", dist.get_world_size())
        self.worker = Worker(o.job_id or default_job_id(), self.specs, group_size, address=o.address, policy=o.policy,
                             fallback=o.fallback, lookahead=lookahead, **extra)
        names = ", ".join(f"'{s.name}' ({len([u for u in s.units if u.name])} layer units)" for s in self.specs)
        print(f"{self.who}: rank {self.worker.rank}: job '{o.job_id or default_job_id()}', "
              f"shard group {list(self.worker.group.ranks)}, controlled {names}", file=sys.stderr, flush=True)

    def _default_plan_fn(self, model: Any) -> Callable[[Any], Mapping[str, int]]:
        from . import hf

        o = self.options
        try:
            return hf.plan_fn(model, extra_towers=o.extra_towers, extra_projectors=o.extra_projectors,
                              trainable=o.trainable)
        except InvalidArgument as e:
            raise InvalidArgument(f"{self.who}: {e}; give it as plan_fn=") from None

    def shard_towers(self, model: Any, mesh: Any = None, fully_shard_kwargs: Optional[Mapping[str, Any]] = None,
                     per_step: int = 1) -> None:
        """Phase one under FSDP2: connects this rank's worker (its shard group the mesh's shard
        dimension, checked) and makes the towers' layer units FSDP units on ``mesh``."""
        from . import fsdp2

        if self.started:
            return
        self._connect(model, len(fsdp2.mesh_shard_ranks(mesh)), per_step)
        try:
            fsdp2.check_shard_group(self.worker, mesh)
            self.towers = fsdp2.shard_towers(model, self.specs, mesh, **dict(fully_shard_kwargs or {}))
        except BaseException as e:
            self.close(e)
            raise

    def attach(self, root: Any = None) -> None:
        """Phase two under FSDP2, once the framework wrapped the root: the control, then
        :attr:`microbatches`. Idempotent."""
        from . import fsdp2

        if self.microbatches is not None:
            return
        if self.towers is None:
            raise FailedPrecondition(f"{self.who}: attach() before shard_towers()")
        o = self.options
        try:
            self.control = fsdp2.attach(self.towers, root, o.fill_missing_grads, o.root_release)
        except BaseException as e:
            self.close(e)
            raise
        self.microbatches = Microbatches(self.worker, self.control, self.plan_fn, timeout=o.timeout)

    def shard_plain(self, model: Any, per_step: int = 1) -> None:
        """Both phases for a model the framework does not shard (DDP, one process): the plain
        executor over the shard group (the world; ``Options.worker['group_size']`` is not taken:
        the group is every rank)."""
        import torch.distributed as dist

        if self.started:
            return
        self._connect(model, dist.get_world_size() if dist.is_initialized() else 1, per_step)
        try:
            self.control = plain_executor(model, self.specs, self.worker)
        except BaseException as e:
            self.close(e)
            raise
        self.microbatches = Microbatches(self.worker, self.control, self.plan_fn, timeout=self.options.timeout)

    def close(self, error: Optional[BaseException] = None) -> None:
        """Ends the session (as failed with ``error``'s text when given). Idempotent."""
        if self.microbatches is not None:
            self.microbatches.close(error)
        elif self.worker is not None and not self.worker.closed:
            if error is None:
                self.worker.close()
            else:
                self.worker.fail(f"{type(error).__name__}: {error}")

    def iterate(self, batches: Iterable[Any], per_step: int = 1) -> Iterator[Any]:
        """:meth:`Microbatches.iterate` of this session (after :meth:`attach` / :meth:`shard_plain`)."""
        if self.microbatches is None:
            raise FailedPrecondition(f"{self.who}: iterate() before the towers were sharded and attached")
        return self.microbatches.iterate(batches, per_step)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self.close(exc)
