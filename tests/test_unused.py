"""find_unused_parameters="auto" (lightning_solo.ddp.unused.policy) and the end-of-fit advice (lightning_solo.ddp.advice).

Raw-DDP scenarios run in 2 real gloo processes (tests/distributed.run_ranks), all in one launch; the
Lightning checks go through SoloDDP's fork launcher and the harness of tests/helpers/equivalence.py, and compare
with the single-process run, so "trains" means "trains the same as one process would".
"""

from __future__ import annotations

import gc
import pickle
import weakref

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_solo import SoloDDP
from lightning_solo.callbacks import TrainingDoctor
from lightning_solo.ddp.advice import ddp_advice
from lightning_solo.ddp.unused.policy import UnusedParameters
from tests.distributed import run_ranks
from tests.helpers import equivalence as eq
from tests.helpers.equivalence import Net, assert_ranks_identical, fit, make_data, max_rel_err, reference
from tests.helpers.records import read_rank_records, write_rank_record

# ------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("bad", ["maybe", "True", None, 1, 0.0])
def test_bad_find_unused_parameters_raises_listing_accepted_values(bad):
    with pytest.raises(ValueError, match=r"\(True, False, 'auto'\)"):
        SoloDDP(find_unused_parameters=bad)


def test_policy_knobs_validated_and_user_values_passed_through():
    with pytest.raises(ValueError, match="window"):
        UnusedParameters(window=0)
    with pytest.raises(ValueError, match="window"):
        UnusedParameters(window=True)
    for value in (True, False):
        strategy = SoloDDP(find_unused_parameters=value)
        assert strategy._ddp_kwargs["find_unused_parameters"] is value
        assert strategy.decisions["find_unused_parameters"].reason == "set by the user"
    auto = SoloDDP()
    assert auto._ddp_kwargs["find_unused_parameters"] is True  # the evidence window runs on True
    assert auto.decisions["find_unused_parameters"].value == "auto"
    static = SoloDDP(static_graph=True)
    assert static._ddp_kwargs["find_unused_parameters"] is False
    assert "static_graph" in static.decisions["find_unused_parameters"].reason


# ------------------------------------------------------------------ raw DDP, 2 gloo processes

WINDOW, RAW_STEPS = 4, 12


class _Raw(nn.Module):
    def __init__(self, head: bool):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        if head:
            self.head = nn.Linear(4, 2)

    def forward(self, x, use_b=True, use_head=False):
        h = self.a(x)
        h = self.b(h) if use_b else h
        return self.c(h) + (self.head(h).sum() if use_head else 0)


# name: (has a head, (step, rank) -> (use b in the synchronised micro-batch, use the head))
SCENARIOS = {
    "all_used": (False, lambda step, rank: (True, False)),
    "static_head": (True, lambda step, rank: (True, False)),
    "branch_off_in_window": (True, lambda step, rank: (step != 1, False)),
    "branch_off_later_one_rank": (False, lambda step, rank: (not (step == 6 and rank == 1), False)),
    "branch_off_later_all_ranks": (False, lambda step, rank: (step != 6, False)),
    "head_used_later": (True, lambda step, rank: (True, step == 7 and rank == 0)),
}


def _train(rank: int, name: str, setting, accumulate: int, group):
    has_head, plan = SCENARIOS[name]
    torch.manual_seed(0)
    model = _Raw(has_head)
    policy = UnusedParameters(setting, window=WINDOW)
    ddp = policy.bind(DDP(model, find_unused_parameters=policy.initial, gradient_as_bucket_view=True), group)
    # AdamW with weight decay: a parameter given a zero gradient instead of None moves (momentum, decay).
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    data = torch.Generator().manual_seed(1 + rank)
    wrappers, errors = 1, 0
    for step in range(RAW_STEPS):
        if policy.at_boundary(ddp):
            errors += ddp._get_ddp_logging_data().get("has_error", 0)
            ddp = policy.rebuild(policy.unwrap(ddp), lambda module: DDP(module, find_unused_parameters=policy.find_unused,
                                                        gradient_as_bucket_view=True, init_sync=False), group)  # fmt: skip
            wrappers += 1
        use_b, use_head = plan(step, rank)
        for micro in range(accumulate):
            last = micro == accumulate - 1
            x = torch.randn(3, 4, generator=data)
            if last:
                policy.before_backward(ddp)
                ddp(x, use_b, use_head).sum().backward()
            else:
                with ddp.no_sync():
                    ddp(x, True, use_head).sum().backward()
        policy.after_backward(ddp)
        opt.step()
        opt.zero_grad()
    policy.finish(ddp)
    advice = ddp_advice(ddp, policy)
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return {
        "params": params, "value": policy.decision.value, "reason": policy.decision.reason, "phase": policy.phase,
        "unused": policy.unused_names, "varying": policy.varying_names, "ignored": sorted(ddp.parameters_to_ignore),
        "find_unused": ddp.find_unused_parameters, "wrappers": wrappers, "advice": advice,
        "ddp_errors": errors + ddp._get_ddp_logging_data().get("has_error", 0),
    }  # fmt: skip


def _all_scenarios(rank: int, world_size: int):
    group = torch.distributed.new_group(backend="gloo")  # the side channel: apart from DDP's group
    out = {}
    for name in SCENARIOS:
        for accumulate in (1, 2):
            out[name, accumulate, "auto"] = _train(rank, name, "auto", accumulate, group)
            out[name, accumulate, True] = _train(rank, name, True, accumulate, group)
    return out


@pytest.fixture(scope="module")
def raw():
    return run_ranks(_all_scenarios, 2, timeout=90)


EXPECTED = {
    # name: (final find_unused_parameters, phase, unused (never used in the window), varying, wrappers)
    # The window runs on True; the fast path is a re-wrap; a later event switches back with another.
    "all_used": (False, "fast", [], [], 2),
    "static_head": (False, "excluding", ["head.weight", "head.bias"], [], 2),
    "branch_off_in_window": (True, "searching", ["head.weight", "head.bias"], ["b.weight", "b.bias"], 1),
    "branch_off_later_one_rank": (True, "searching", [], ["b.bias", "b.weight"], 3),
    "branch_off_later_all_ranks": (True, "searching", [], ["b.bias", "b.weight"], 3),
    "head_used_later": (True, "searching", ["head.weight", "head.bias"], ["head.bias", "head.weight"], 3),
}
# With accumulation, b skipped in step 1's last micro-batch was still used in its first: DDP counts the step.
EXPECTED_ACCUMULATING = {"branch_off_in_window": (False, "excluding", ["head.weight", "head.bias"], [], 2)}


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_raw_ddp_auto_decides_never_crashes_and_trains_like_true(raw, name, accumulate):
    r0, r1 = (raw[rank][name, accumulate, "auto"] for rank in (0, 1))
    final, phase, unused, varying, wrappers = (EXPECTED_ACCUMULATING if accumulate > 1 else {}).get(
        name, EXPECTED[name]
    )
    assert (r0["find_unused"], r0["phase"], r0["unused"], r0["varying"], r0["wrappers"]) == (
        final,
        phase,
        unused,
        varying,
        wrappers,
    )
    same = {k for k in r0 if k not in ("params", "advice")}  # the advice carries each rank's own timings
    assert {k: r0[k] for k in same} == {k: r1[k] for k in same}
    for n, p in r0["params"].items():
        assert np.isfinite(p).all() and np.array_equal(p, r1["params"][n]), n
    if phase == "excluding":
        assert r0["ignored"] == ["head.bias", "head.weight"]
        assert any("excluded from synchronisation" in line and "head.weight" in line for line in r0["advice"])
    if wrappers == 3:
        assert "switched to find_unused_parameters=True" in r0["reason"]
    assert r0["ddp_errors"] == 0  # the fast path's events are handled, not recorded by DDP as errors
    # Every step, the event steps included, computes what find_unused_parameters=True computes (AdamW with
    # weight decay: a zero gradient where True leaves None would move the parameter).
    exact = raw[0][name, accumulate, True]["params"]
    for n, p in r0["params"].items():
        np.testing.assert_allclose(p, exact[n], rtol=1e-5, atol=1e-7, err_msg=n)


def _freeze_inside_a_step(rank: int, world_size: int):
    torch.manual_seed(0)
    model = _Raw(head=False)
    policy = UnusedParameters("auto", window=WINDOW)
    group = torch.distributed.new_group(backend="gloo")
    ddp = policy.bind(DDP(model, find_unused_parameters=True), group)
    for step in range(RAW_STEPS):
        if policy.at_boundary(ddp):
            ddp = policy.rebuild(policy.unwrap(ddp), lambda module: DDP(module, init_sync=False), group)
        if step == 6:
            model.b.requires_grad_(False)  # inside the step: DDP was built with b trainable
        policy.before_backward(ddp)
        ddp(torch.randn(3, 4)).sum().backward()
        try:
            policy.after_backward(ddp)
        except RuntimeError as error:
            return str(error)
    return None


@pytest.mark.multiproc
def test_parameter_frozen_inside_a_step_is_named_with_the_step_and_the_fix():
    messages = run_ranks(_freeze_inside_a_step, 2, timeout=50)
    for message in messages:
        assert "b.weight, b.bias stopped requiring grad during step 6" in message
        assert "change requires_grad at a batch boundary" in message.replace("Change", "change")


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_advice_from_ddp_logging_data(raw):
    fast = raw[0]["all_used", 1, "auto"]["advice"]
    assert any("fast path" in line for line in fast)
    assert any("no comm hook" in line for line in fast)
    assert any(line.startswith("1 gradient bucket(s)") and "bucket_cap_mb=25" in line for line in fast)
    user_true = raw[0]["all_used", 1, True]["advice"]
    assert any("find_unused_parameters=True" in line and "0.00 MiB" in line for line in user_true)
    assert any("'auto'" in line for line in user_true)  # True was never needed
    dynamic = raw[0]["branch_off_in_window", 1, "auto"]["advice"]
    assert any("find_unused_parameters=True" in line and "b.weight" in line for line in dynamic)


# ----------------------------------------------------------------- Lightning, 2 fork processes

STEPS, TOL, STEPS_LATE = eq.STEPS, eq.TOL, 24
CASES = {
    # name: (variant, step -> ranks whose batch leaves the branch unused, steps, DDP wrappers used)
    "static_head": ("head", {}, STEPS, 2),  # the window on True, then the fast path without the head
    "branch_off_in_window": ("branch", {1: (0, 1)}, STEPS, 2),  # stays on True, re-wrapped without the probe
    # The fast path from step 4; step 6 leaves the branch unused on rank 1 only (completed exactly; every rank
    # learns it at step 7, still on the fast path), True from step 8; at step 20 no rank uses it.
    "branch_off_after_window": ("branch", {6: (1,), 20: (0, 1)}, STEPS_LATE, 3),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(CASES))
def test_unused_parameters_train_like_one_process_under_solo_ddp(tmp_path, case):
    variant, off, steps, wrappers = CASES[case]
    torch.manual_seed(0)
    net = Net(variant, make_data(steps, branch_off=off))
    records = fit(tmp_path, net, "solo_ddp_notebook", steps=steps)  # SoloDDP with the fork launcher, by name
    assert_ranks_identical(records)
    assert max_rel_err(records[0], reference(net, steps=steps)) <= TOL
    decision = records[0]["decisions"]["find_unused_parameters"]
    warnings = records[0]["warnings"]
    assert records[0]["wrappers"] == wrappers
    if case == "static_head":
        assert decision["value"] is False and "excluded from synchronisation" in decision["reason"]
        assert records[0]["ddp"]["find_unused_parameters"] is False
        assert records[0]["ddp"]["ignored"] == ["head.bias", "head.weight"]
        assert len(warnings) == 1 and "head.weight, head.bias" in warnings[0]
    elif case == "branch_off_in_window":
        assert decision["value"] is True and "some steps or ranks" in decision["reason"]
        assert records[0]["ddp"]["find_unused_parameters"] is True
        assert len(warnings) == 1 and "branch.weight, branch.bias" in warnings[0]
    else:
        assert decision["value"] is True and "switched to find_unused_parameters=True from step 8" in decision["reason"]
        assert records[0]["ddp"]["find_unused_parameters"] is True
        assert len(warnings) == 1 and "switching" in warnings[0] and "branch.weight, branch.bias" in warnings[0]
    assert records[1]["warnings"] == []  # rank zero only


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["static_head", "branch_off_in_window"])
def test_stock_ddp_fails_on_the_same_models(tmp_path, case):
    variant, off, _, _ = CASES[case]
    net = Net(variant, make_data(branch_off=off))
    with pytest.raises(Exception, match=r"parameters that were not used|did not receive grad"):
        fit(tmp_path, net, DDPStrategy(start_method="fork"))


@pytest.mark.multiproc
def test_solo_ddp_with_false_says_to_use_auto(tmp_path):
    net = Net("head", make_data())
    with pytest.raises(Exception, match="SoloDDP was given find_unused_parameters=False; leave it at 'auto'"):
        fit(tmp_path, net, SoloDDP(start_method="fork", find_unused_parameters=False))


@pytest.mark.multiproc
def test_rewrap_keeps_the_comm_hook(tmp_path):
    # PowerSGD compresses from step 2, before auto's re-wrap at step 4: the new wrapper gets the hook again.
    torch.manual_seed(0)
    net = Net("head", make_data())
    records = fit(tmp_path, net, SoloDDP(start_method="fork", comm_hook="powersgd", powersgd_start_iter=2))
    assert_ranks_identical(records)
    assert records[0]["wrappers"] == 2
    assert records[0]["ddp"]["ignored"] == ["head.bias", "head.weight"]
    assert "powerSGD" in records[0]["ddp"]["comm_hook"]


class _Manual(Net):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.mse_loss(self(batch[0]), batch[1]))
        opt.step()


@pytest.mark.multiproc
def test_manual_optimization_is_covered_too(tmp_path):
    # Lightning prepares DDP's backward itself here (pre_backward); the safety net and switch work the same.
    torch.manual_seed(0)
    net = _Manual("branch", make_data(STEPS_LATE, branch_off=CASES["branch_off_after_window"][1]))
    records = fit(tmp_path, net, SoloDDP(start_method="fork"), steps=STEPS_LATE)
    assert_ranks_identical(records)
    assert max_rel_err(records[0], reference(net, steps=STEPS_LATE)) <= TOL
    assert "switched" in records[0]["decisions"]["find_unused_parameters"]["reason"]


# --------------------------------------------------------- a re-wrap holds one set of DDP buckets at a time


_EARLIER: list[weakref.ref] = []  # per rank process: every wrapper built
_ALIVE: list[int] = []  # per rank process: earlier wrappers alive as each was built


class _OneAtATime(DDP):
    """DDP that notes, as each wrapper is built, how many earlier ones are still alive (after a collection): each
    one's reducer owns gradient buckets as big as all the gradients. Patched in before the fit: the fork launcher's
    ranks inherit it."""

    def __init__(self, *args, **kwargs):
        gc.collect()
        _ALIVE.append(sum(ref() is not None for ref in _EARLIER))
        super().__init__(*args, **kwargs)
        _EARLIER.append(weakref.ref(self))


class _Alive(L.Callback):
    def __init__(self, path):
        self.path = path

    def on_fit_end(self, trainer, pl_module):
        write_rank_record(self.path, trainer.global_rank, {"alive": _ALIVE})


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("comm_hook", [None, "auto"])
def test_a_rewrap_frees_the_old_wrapper_before_building_the_next(tmp_path, monkeypatch, comm_hook):
    # "auto"'s window ends after step 4 (the fast path: a re-wrap); comm_hook="auto" re-wraps after each
    # candidate's 7 steps too. TrainingDoctor follows the wrappers' timings across the re-wraps.
    for where in ("lightning_solo.ddp.strategy", "lightning.pytorch.strategies.ddp"):
        monkeypatch.setattr(f"{where}.DistributedDataParallel", _OneAtATime)
    steps = 9 if comm_hook else 6
    (tmp_path / "alive").mkdir()
    doctor = TrainingDoctor(chart=None)
    strategy = SoloDDP(start_method="fork", comm_hook=comm_hook)
    records = fit(tmp_path, Net("used", make_data(steps)), strategy, steps=steps,
                  callbacks=[doctor, _Alive(tmp_path / "alive")])  # fmt: skip
    assert records[0]["wrappers"] == (3 if comm_hook else 2)
    for record in read_rank_records(tmp_path / "alive"):
        assert record["alive"] == [0] * records[0]["wrappers"], record


_READS: list[str] = []  # module-wide: a pickled copy of a reader would append here too


class _Reader:
    def read(self, ddp):
        _READS.append(ddp)


def test_rewrap_listeners_are_held_weakly_and_never_pickled():
    strategy, reader = SoloDDP(), _Reader()
    strategy.add_rewrap_listener(reader.read)
    pickle.loads(pickle.dumps(strategy))._rewrap_listeners("copy")  # spawn pickles the strategy
    strategy._rewrap_listeners("old")
    assert _READS == ["old"]
    owner = weakref.ref(reader)
    del reader
    assert owner() is None  # the listener never keeps its owner alive
    strategy._rewrap_listeners("later")
    assert _READS == ["old"]
