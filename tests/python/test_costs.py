"""shardcoord.torch.CostMeter on CPU: forward seconds per call, unit gathers, medians, memory and the
report to a worker. No daemon, no GPU; a clock the test drives makes the timings exact."""

import types

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import shardcoord.torch as sct  # noqa: E402


class Clock:
    """time.perf_counter for the meter: advances only when the test says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Block(nn.Linear):
    def __init__(self, clock, cost):
        super().__init__(8, 8)
        self.clock, self.cost = clock, cost

    def forward(self, x):
        self.clock.now += self.cost[0]
        return super().forward(x)


class Tower(nn.Module):
    def __init__(self, clock, cost):
        super().__init__()
        self.proj = nn.Linear(8, 8)  # Outside the layer list: the rest unit.
        self.blocks = nn.ModuleList([Block(clock, cost) for _ in range(3)])

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x


class Model(nn.Module):
    def __init__(self, clock=None, cost=None):
        super().__init__()
        self.clock = clock or Clock()
        self.cost = cost or [0.0]  # Seconds each block adds to the clock.
        self.visual = Tower(self.clock, self.cost).requires_grad_(False)
        self.head = nn.Linear(8, 2)

    def forward(self, x, calls=1):
        for _ in range(calls):
            with torch.no_grad():
                x = self.visual(x)
        return self.head(x)


def nbytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def specs(model):
    """The manifest's shape (name, param_bytes, units), without the binding."""
    tower = model.visual
    units = [types.SimpleNamespace(name="", param_bytes=nbytes(tower.proj))]
    units += [types.SimpleNamespace(name=f"blocks.{i}", param_bytes=nbytes(b)) for i, b in enumerate(tower.blocks)]
    return [types.SimpleNamespace(name="visual", param_bytes=nbytes(tower), units=units)]


def test_measures_positive_forward_time_and_counts_calls_with_the_real_clock():
    model = Model()
    meter = sct.CostMeter.attach(model, specs(model))
    for calls in (1, 2, 3):
        meter.next_microbatch()
        model(torch.randn(64, 8), calls=calls)
    assert meter.calls("visual") == 6
    [(name, forward, units)] = meter.costs()
    assert name == "visual" and forward > 0
    assert units == []  # Nothing gathers an unsharded module's units.


def test_forward_seconds_per_call_is_the_median_of_the_last_window_samples():
    clock, cost = Clock(), [0.0]
    model = Model(clock, cost)
    meter = sct.CostMeter.attach(model, ["visual"], window=5, clock=clock)
    for seconds in (0.5, 0.5, 0.01, 0.01, 9.0, 0.01, 0.01):  # A slow outlier among 3-block calls.
        cost[0] = seconds / 3
        model(torch.randn(2, 8))
    [(_, forward, _units)] = meter.costs()
    assert forward == pytest.approx(0.01)  # Median of the last 5: 0.01 0.01 9.0 0.01 0.01.
    assert meter.calls("visual") == 7


def test_costs_are_zero_before_the_module_ran_and_the_window_must_be_positive():
    model = Model()
    meter = sct.CostMeter.attach(model, specs(model))
    assert meter.costs() == [("visual", 0.0, [])]
    with pytest.raises(ValueError, match="window"):
        sct.CostMeter(window=0)


def test_headroom_is_minus_one_and_the_budget_unmeasured_on_cpu():
    model = Model()
    meter = sct.CostMeter.attach(model, specs(model))
    model(torch.randn(2, 8))
    meter.end_step()
    assert meter.headroom_bytes() == -1
    assert meter.frozen_budget_bytes() == 0


def test_what_is_held_outside_the_model_counts_as_held():
    """A replica fsdp2 keeps outside the model is memory the frozen modules hold: a measured room
    that missed it would be one tower low, and auto would demote the replica it just made."""
    model = Model()
    plain = sct.CostMeter.attach(model, specs(model))
    outside = sct.CostMeter.attach(model, specs(model), held_outside=lambda: 12345)
    assert outside._held_bytes() == plain._held_bytes() + 12345
    assert plain._held_bytes() == nbytes(model.visual)


def test_report_gives_the_worker_the_costs_and_the_budget_in_the_bound_shapes():
    clock, cost = Clock(), [0.002]
    model = Model(clock, cost)
    meter = sct.CostMeter.attach(model, specs(model), clock=clock)
    model(torch.randn(2, 8))
    got = []
    worker = types.SimpleNamespace(report_costs=lambda costs, budget: got.append((costs, budget)))
    assert meter.report(worker) is True
    [(costs, budget)] = got
    assert budget == 0 and isinstance(costs, list)
    [(name, forward, units)] = costs
    assert (name, units) == ("visual", []) and isinstance(forward, float)
    assert forward == pytest.approx(0.006)


def test_a_worker_without_report_costs_is_left_alone():
    model = Model()
    meter = sct.CostMeter.attach(model, specs(model))
    model(torch.randn(2, 8))
    assert meter.report(types.SimpleNamespace()) is False
    assert meter.report(object()) is False


class FsdpLikeBlock(Block):
    """A stand-in for an FSDP2 unit: unshard / reshard, gathering inside its pre-forward hook."""

    def __init__(self, clock, cost, gather):
        super().__init__(clock, cost)
        self.gather, self.unsharded, self.explicit = gather, False, 0
        self.register_forward_pre_hook(lambda m, a: self._pre_forward())

    def _pre_forward(self):
        if not self.unsharded:
            self.clock.now += self.gather

    def unshard(self, async_op=False):
        self.explicit += 1
        if not async_op:
            self.clock.now += 2 * self.gather
        self.unsharded = True

    def reshard(self):
        self.unsharded = False


def fsdp_like_model(gather):
    clock, cost = Clock(), [0.001]
    model = Model(clock, cost)
    model.visual.blocks = nn.ModuleList([FsdpLikeBlock(clock, cost, gather) for _ in range(3)])
    model.visual.requires_grad_(False)
    return model, clock


def test_unit_gathers_are_measured_and_not_counted_as_forward():
    model, clock = fsdp_like_model(gather=0.004)
    meter = sct.CostMeter.attach(model, specs(model), clock=clock)
    model(torch.randn(2, 8))  # per_layer: each unit gathered in its pre-forward.
    [(_, forward, units)] = meter.costs()
    assert forward == pytest.approx(0.003)  # 3 blocks x 1 ms of compute, the gathers left out.
    block_bytes = nbytes(model.visual.blocks[0])
    assert units == [(f"blocks.{i}", block_bytes, pytest.approx(0.004)) for i in range(3)]


def test_an_explicit_unshard_is_the_gather_a_unit_reports_and_detach_undoes_the_wrapping():
    model, clock = fsdp_like_model(gather=0.004)
    meter = sct.CostMeter.attach(model, specs(model), clock=clock)
    for block in model.visual.blocks:  # root: every unit gathered up front (8 ms each here).
        block.unshard()
    handle = model.visual.blocks[0].unshard(async_op=True)  # Not timed: waited on elsewhere.
    assert handle is None
    model(torch.randn(2, 8))  # Already gathered: the pre-forward samples are 0.
    [(_, forward, units)] = meter.costs()
    assert [s for _, _, s in units] == [pytest.approx(0.008)] * 3  # Explicit gathers win.
    assert forward == pytest.approx(0.003)
    meter.detach()
    assert "unshard" not in vars(model.visual.blocks[0])
    model(torch.randn(2, 8))
    assert meter.calls("visual") == 1


def test_a_forward_that_fails_leaves_nothing_open():
    clock, cost = Clock(), [0.001]
    model = Model(clock, cost)
    meter = sct.CostMeter.attach(model, ["visual"], clock=clock)
    with pytest.raises(RuntimeError):
        model.visual(torch.randn(2, 5))  # Wrong width: fails inside the forward.
    meter.next_microbatch()
    model(torch.randn(2, 8))
    [(_, forward, _units)] = meter.costs()
    assert forward == pytest.approx(0.003)


def test_with_the_plain_executor_per_layer_the_units_it_gathers_are_measured():
    try:
        import shardcoord
        shardcoord.ModuleSpec  # noqa: B018 - the binding (the executor checks its manifest's type)
    except ImportError as e:
        pytest.skip(f"shardcoord's binding is not built: {e}")
    clock, cost = Clock(), [0.001]
    model = Model(clock, cost)
    manifest = sct.manifest(model)
    ex = sct.Executor(model, manifest, rank_in_group=0, group_size=1)
    materialize = ex._materialize

    def slow_materialize(mod, unit):  # A gather of 5 ms, as the clock sees it.
        clock.now += 0.005
        materialize(mod, unit)

    ex._materialize = slow_materialize
    meter = sct.CostMeter.attach(model, manifest, clock=clock)
    for _ in range(2):
        meter.next_microbatch()
        ex.begin_microbatch({"visual": "per_layer"})
        model(torch.randn(2, 8))
        ex.end_microbatch()
    [(name, forward, units)] = meter.costs()
    assert name == "visual" and forward == pytest.approx(0.003)
    assert [u for u, _, _ in units] == ["", "blocks.0", "blocks.1", "blocks.2"]  # Manifest order.
    assert all(s == pytest.approx(0.005) for _, _, s in units)
    assert {u: b for u, b, _ in units} == {u.name: u.param_bytes for u in manifest[0].units}
