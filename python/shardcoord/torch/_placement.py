"""What a decision means for one module on this rank, for every executor that carries one out:
the plain ``torch.distributed`` executor (``_executor.py``), ``shardcoord.fsdp2`` and, through it,
the framework integrations. The placement kinds are the rows of ``decisions.def`` (C++); this
module is their one home on the Python side: a decision's (kind, passes) read from whatever a
caller holds, a padded decision's plan on this rank, the order of pad passes, and whether a
module's output needs its backward."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import FailedPrecondition, InvalidArgument

DECISIONS = ("skip", "per_layer", "root", "replicate", "padded")
PER_LAYER_HOOKS = ("per_layer", "padded")  # Decisions under which the model's own calls gather each unit.


def decision_of(name: str, entry: Any) -> Tuple[str, int]:
    """(decision, passes) of one module's entry in a decision: a ``ModuleDecision`` (or anything
    with its ``decision`` and, for padded, ``calls``), a decision name, or ``("padded", K)`` (K: the
    busiest rank's calls, the all-gather passes each rank makes; 0 for every other decision)."""
    if isinstance(entry, str):
        kind, passes = entry, 0
        if kind == "padded":
            raise InvalidArgument(f"module '{name}' is decided \"padded\" without its number of passes: give "
                                  f"(\"padded\", K), K the most calls any rank of the group makes in the microbatch "
                                  f"(ModuleDecision.calls)")
    elif isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str) \
            and isinstance(entry[1], int) and not isinstance(entry[1], bool):
        kind, passes = entry[0], entry[1]
    elif isinstance(getattr(entry, "decision", None), str):
        kind, passes = entry.decision, getattr(entry, "calls", 0)
    else:
        raise InvalidArgument(f"the decision for module '{name}' must be a decision name, (\"padded\", K) or a "
                              f"shardcoord.ModuleDecision, got {entry!r}")
    if kind not in DECISIONS:
        raise InvalidArgument(f"unknown decision '{kind}' for module '{name}' (known: {', '.join(DECISIONS)})")
    if kind == "padded" and passes < 1:
        raise InvalidArgument(f"module '{name}' is decided `padded` with {passes} passes: K must be >= 1 (the most "
                              f"calls any rank makes; a ModuleDecision without `calls` comes from a binding that "
                              f"predates `padded`: rebuild it)")
    if kind != "padded" and passes != 0:
        raise InvalidArgument(f"module '{name}' is decided `{kind}` with {passes} passes: only `padded` carries a "
                              f"number of passes; give the decision's name alone")
    return kind, passes


def padded_plan(chosen: Mapping[str, Tuple[str, int]], calls: Optional[Mapping[str, int]]) -> Dict[str, int]:
    """module -> this rank's planned calls, for each module decided ``padded`` in ``chosen``
    (module -> (decision, passes)), checked against its passes K."""
    planned = {}
    for name in [name for name, (kind, _) in chosen.items() if kind == "padded"]:
        passes = chosen[name][1]
        n = None if calls is None else calls.get(name)
        if n is None:
            raise InvalidArgument(f"module '{name}' is decided `padded` ({passes} all-gather passes on every rank) but "
                                  f"begin_microbatch got no calls for it: pass calls={{'{name}': n}}, n this rank's "
                                  f"planned calls (the plan it reported), so that it pads the other {passes} - n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidArgument(f"calls['{name}'] must be a non-negative int (this rank's planned calls), got {n!r}")
        if n > passes:
            raise FailedPrecondition(
                f"this rank planned {n} calls of '{name}', but the group's `padded` decision makes {passes} passes "
                f"(the most calls any rank planned): its plan and the decision disagree; give begin_microbatch the "
                f"calls this rank reported for this microbatch, with this microbatch's decision")
        planned[name] = n
    return planned


class PadChain:
    """The order in which this rank makes the all-gather passes of a microbatch's ``padded``
    modules (the C++ executor's AdvancePads / CheckPaddedOrder).

    Every rank makes K passes over each padded module, c of them its real calls and K - c pad
    passes; the group's all-gathers pair only when every rank makes them module by module, in
    manifest order, before any other module's. The chain walks the modules in manifest order from
    :meth:`start`: at a padded module it issues the K - c pad passes (``pad(module, passes)``),
    then stops there while this rank has real calls of it left; the end of the last of them
    (:meth:`after_call`) moves it on. Modules that are not padded are passed over. A call out of
    that order (a padded module before the chain reached it, a per_layer one before the chain
    finished) is refused by :meth:`before_call`, before anything is gathered."""

    def __init__(self, names: Sequence[str], pad: Callable[[str, int], None], who: str = "",
                 unstarted: str = "the chain never started"):
        self._names = list(names)  # The modules that gather, in manifest order.
        self._index = {name: i for i, name in enumerate(self._names)}
        self._pad = pad
        self._who = who  # Prefix of the messages ("fsdp2: ").
        self._unstarted = unstarted  # Why no pad was issued when the chain never started.
        self.begin({})

    def begin(self, plan: Mapping[str, Tuple[int, int]]) -> None:
        """A microbatch: ``plan`` is module -> (K, c) for its padded modules (``{}``: none, and
        outside a microbatch). The pads come from :meth:`start`."""
        self._plan = {name: plan[name] for name in self._names if name in plan}
        self._calls = dict.fromkeys(self._plan, 0)
        self._issued: set = set()  # Modules whose pad passes were issued.
        self._at: Optional[int] = None  # Where the chain stopped (len: finished); None: not started.

    @property
    def waiting(self) -> bool:
        """Modules are padded in this microbatch and the chain has not started."""
        return bool(self._plan) and self._at is None

    def start(self) -> None:
        """Issues the pads up to the first padded module this rank still calls (once a microbatch)."""
        if self.waiting:
            self._advance(0)

    def _advance(self, i: int) -> None:
        while i < len(self._names):
            name = self._names[i]
            if name in self._plan:
                passes, planned = self._plan[name]
                if name not in self._issued:
                    self._issued.add(name)
                    self._pad(name, passes - planned)
                if self._calls[name] < planned:
                    break
            i += 1
        self._at = i

    def before_call(self, name: str, decision: str) -> None:
        """A call of module ``name`` (decided ``decision``) starts: refused, before it gathers,
        out of the chain's order or beyond this rank's planned calls."""
        if not self._plan or self._at is None or name not in self._index:
            return
        # A per_layer call gathers in the forward; root, replicate and skip gather nothing there.
        early = self._at < self._index[name] if name in self._plan else decision == "per_layer"
        if self._at < len(self._names) and early:
            raise self._out_of_order(name, decision, self._names[self._at])
        if name in self._plan:
            self._calls[name] += 1
            passes, planned = self._plan[name]
            if self._calls[name] > planned:
                raise FailedPrecondition(
                    f"{self._who}'{name}' is called under `padded` (call {self._calls[name]} of the microbatch), but "
                    f"this rank planned {planned} call(s) and padded the other {passes - planned} of the group's "
                    f"{passes} passes: this call would all-gather on this rank alone; give begin_microbatch the "
                    f"calls this rank makes (the plan it reported)")

    def _out_of_order(self, name: str, decision: str, first: str) -> FailedPrecondition:
        planned = self._plan[first][1]
        where = (f"{self._who}'{name}' is called while padded module '{first}' has not finished its {planned} "
                 f"planned call(s) of the microbatch ({self._calls[first]} begun)")
        if decision == "padded":
            return FailedPrecondition(
                f"{where}: every rank makes the padded modules' passes (calls, or pads on the ranks that call "
                f"less) module by module in manifest order, '{first}' before '{name}', so this call's all-gathers "
                f"would pair with other units on the other ranks; make the forward run every call of '{first}' "
                f"before the first of '{name}', or order the manifest as the forward calls the padded modules")
        return FailedPrecondition(
            f"{where}, and '{name}' is decided `{decision}`: every rank makes the padded modules' passes before "
            f"any other controlled module's call, so this call's all-gathers would pair with '{first}''s on the "
            f"ranks that pad it; make the forward run the padded modules (in manifest order) before any other "
            f"controlled module, or choose another fallback (root or replicate) for this model")

    def after_call(self, name: str) -> None:
        """A call of ``name`` ended: after this rank's last planned call of it, the chain moves on."""
        i = self._index.get(name)
        if i is not None and name in self._plan and self._at == i and self._calls[name] >= self._plan[name][1]:
            self._advance(i + 1)

    def wrong(self) -> List[str]:
        """What this rank's padded modules did other than planned ([]: nothing)."""
        wrong = []
        for name, (passes, planned) in self._plan.items():
            if name not in self._issued and passes > planned:
                why = self._unstarted if self._at is None else \
                    f"the chain stopped at '{self._names[self._at]}', whose planned calls were not all made"
                wrong.append(f"'{name}': {why}, so its {passes - planned} pad pass(es) were not issued")
            elif self._calls[name] != planned:
                wrong.append(f"'{name}' ran {self._calls[name]} call(s), planned {planned} (it padded "
                             f"{passes - planned} of the group's {passes} passes)")
        return wrong


def requires_grad(output: Any) -> bool:
    import torch

    if isinstance(output, torch.Tensor):
        return output.requires_grad
    if isinstance(output, Mapping):
        return any(requires_grad(v) for v in output.values())
    if isinstance(output, (tuple, list)):
        return any(requires_grad(v) for v in output)
    if hasattr(output, "__dataclass_fields__"):
        return any(requires_grad(v) for v in vars(output).values())
    return False
