"""find_unused_parameters="auto" in the combinations users meet: SyncBN with several buckets, collectives in
and right after backward, AdamW, fine-tuning that freezes and unfreezes, a second fit, comm-hook state.

Each fit runs on 2 real gloo processes (SoloDDP's fork launcher) and is compared with the same fit under
``SoloDDP(find_unused_parameters=True)``: the replicas must be identical and the parameters within 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning, Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from lightning_solo import SoloDDP
from lightning_solo.testing import run_ranks
from tests.helpers.equivalence import (
    Net,
    assert_ranks_identical,
    fit,
    local_sgd_reference,
    make_data,
    max_rel_err,
)

TOL = 1e-5
STEPS = 16
LATE = {9: (1,)}  # after the window (steps 0-3): the branch goes unused on rank 1 only at step 9
TINY_BUCKETS = 0.0002  # MiB: several buckets even for this small model


class Combo(Net):
    """``Net`` with the options real models combine: BatchNorm, a gradient-carrying all_gather before the
    branch (its backward then runs after the branch's buckets are launched), a ``sync_dist`` log in
    ``on_after_backward``, AdamW with weight decay, a ``backbone`` for fine-tuning."""

    def __init__(self, data, variant="branch", *, bn=False, gather_from=None, log_after_backward=False,
                 adamw=False, frozen_backbone=False):  # fmt: skip
        super().__init__(variant, data, batchnorm=bn)
        self.gather_from, self.log_after_backward, self.adamw = gather_from, log_after_backward, adamw
        self.backbone = self.trunk
        if frozen_backbone:
            self.backbone.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.trunk(x)
        loss = 0.0
        if self.gather_from is not None and self.global_step >= self.gather_from:
            # Gathered before the branch and the head are applied: in backward, the all_gather's collective
            # comes after their gradient buckets are launched.
            loss = 0.01 * self.all_gather(h, sync_grads=True).pow(2).mean()
        return loss + F.mse_loss(self.after_trunk(h, x), y)

    def on_after_backward(self):
        if self.log_after_backward:
            self.log("trunk_weight_sum", self.trunk[0].weight.detach().sum(), sync_dist=True)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.adamw:
            return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
        return torch.optim.SGD(params, lr=0.05, weight_decay=0.1)


def compare_with_true(tmp_path, net, steps=STEPS, callbacks=(), **solo):
    """Fit ``net`` under "auto" and under True (SoloDDP, same options); return both runs' records."""
    runs = {}
    for setting in ("auto", True):
        strategy = SoloDDP(start_method="fork", find_unused_parameters=setting, **solo)
        runs[setting] = fit(tmp_path / str(setting), copy.deepcopy(net), strategy, steps=steps,
                            callbacks=[copy.deepcopy(c) for c in callbacks])  # fmt: skip
        assert_ranks_identical(runs[setting])
    expected = {n: torch.tensor(p) for n, p in runs[True][0]["params"].items()}
    assert max_rel_err(runs["auto"][0], expected) <= TOL
    return runs


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(dict(bn=True), id="syncbn"),
        pytest.param(dict(gather_from=0), id="all_gather_from_the_start"),
        pytest.param(dict(gather_from=9), id="all_gather_from_the_late_step"),
        pytest.param(dict(log_after_backward=True), id="sync_dist_log_in_on_after_backward"),
    ],
)
def test_collectives_in_and_after_backward_stay_in_order(tmp_path, case):
    torch.manual_seed(0)
    net = Combo(make_data(STEPS, branch_off=LATE), **case)
    runs = compare_with_true(tmp_path, net, bucket_cap_mb=TINY_BUCKETS, sync_batchnorm="bn" in case)
    decision = runs["auto"][0]["decisions"]["find_unused_parameters"]
    if "bn" in case:
        assert "SyncBatchNorm-like layers (trunk.1) communicate inside backward" in decision["reason"]
        assert runs["auto"][0]["wrappers"] == 1  # True from the first step: no hold-back possible
    elif case.get("gather_from") == 0:
        assert "all_gather(sync_grads=True) communicates inside backward" in decision["reason"]
        assert runs["auto"][0]["wrappers"] == 2  # the window's probe leaves DDP when the window closes
    else:  # the fast path until the late step, completed exactly, then True
        assert decision["value"] is True and "switched to find_unused_parameters=True" in decision["reason"]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("off", "first_true"),
    [
        pytest.param(dict.fromkeys(range(8, STEPS), (0, 1)), 10, id="every_rank_from_step_8"),
        # Step 9: rank 1 only (rank 0 learns it a step late); step 10, still on the fast path: no rank.
        pytest.param({9: (1,), 10: (0, 1)}, 11, id="one_rank_then_every_rank"),
    ],
)
def test_adamw_leaves_a_parameter_no_rank_used_alone(tmp_path, off, first_true):
    torch.manual_seed(0)
    runs = compare_with_true(tmp_path, Combo(make_data(STEPS, branch_off=off), adamw=True))
    reason = runs["auto"][0]["decisions"]["find_unused_parameters"]["reason"]
    assert f"switched to find_unused_parameters=True from step {first_true}" in reason  # learnt one step late


class _UnfreezeBackbone(BaseFinetuning):
    """Unfreezes a backbone the model froze in ``__init__``, at ``epoch``."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def freeze_before_training(self, pl_module):
        pass

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == self.epoch:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.05)


class _FreezeAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            pl_module.trunk.requires_grad_(False)


FINETUNE_STEPS, EPOCH = 18, 6  # 3 epochs of 6 steps


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "case",
    [
        pytest.param("backbone_finetuning", id="BackboneFinetuning"),
        pytest.param("frozen_in_init", id="frozen_in_init_unfrozen_at_epoch_1"),
        pytest.param("frozen_mid_fit", id="layer_frozen_mid_fit"),
    ],
)
def test_trainable_set_changes_mid_fit(tmp_path, case):
    torch.manual_seed(0)
    data = make_data(EPOCH, branch_off={4: (1,)})
    net = Combo(data, frozen_backbone=case == "frozen_in_init")
    callbacks = {
        "backbone_finetuning": [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)],
        "frozen_in_init": [_UnfreezeBackbone(epoch=1)],
        "frozen_mid_fit": [_FreezeAt(step=8)],
    }[case]
    runs = compare_with_true(tmp_path, net, steps=FINETUNE_STEPS, callbacks=callbacks)
    # The backbone trained (after the unfreeze) or stopped (after the freeze), on every rank alike.
    assert runs["auto"][0]["params"]["trunk.0.weight"] != net.trunk[0].weight.flatten().tolist()


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_stock_ddp_leaves_an_unfrozen_backbone_unsynchronised_and_so_does_the_switch(tmp_path):
    # Stock: DDP built before the unfreezing never all-reduces the backbone's gradients; its ranks drift apart.
    # SoloDDP(rewrap_on_trainable_change=False) gives that back, rank for rank (the default re-wraps: above).
    torch.manual_seed(0)
    net = Combo(make_data(EPOCH), variant="used", frozen_backbone=True)
    records = {
        name: fit(tmp_path / name, copy.deepcopy(net), strategy, steps=FINETUNE_STEPS,
                  callbacks=[_UnfreezeBackbone(epoch=1)])
        for name, strategy in (("stock", DDPStrategy(start_method="fork")),
                               ("off", SoloDDP(start_method="fork", rewrap_on_trainable_change=False)))
    }  # fmt: skip
    stock, off = records["stock"], records["off"]
    assert stock[0]["params"]["trunk.0.weight"] != stock[1]["params"]["trunk.0.weight"]
    assert [r["params"] for r in off] == [r["params"] for r in stock]
    assert off[0]["decisions"]["rewrap_on_trainable_change"]["value"] is False


class _Wrapped(Callback):
    def on_train_end(self, trainer, pl_module):
        ddp = trainer.strategy.model
        self.ddp = (ddp.find_unused_parameters, sorted(ddp.parameters_to_ignore))


def _two_fits(rank, world_size, tmp):
    """Two fits of one Trainer (one SoloDDP) inside already-running ranks (as under torchrun)."""
    import os
    import warnings

    import lightning as L

    os.environ["LOCAL_RANK"] = str(rank)
    wrapped = _Wrapped()
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=SoloDDP(), max_steps=8,
                        use_distributed_sampler=False, limit_val_batches=0, logger=False, callbacks=[wrapped],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp)  # fmt: skip
    out = []
    for variant in ("head", "used"):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Net(variant, make_data(8)))
        warned = [str(w.message) for w in caught if "SoloDDP" in str(w.message)]
        out.append((trainer.strategy.decisions["find_unused_parameters"], warned, *wrapped.ddp))
        trainer.fit_loop.epoch_loop.max_steps += 8
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_a_second_fit_decides_from_its_own_evidence(tmp_path):
    (first, second), _ = run_ranks(_two_fits, 2, str(tmp_path), timeout=80)
    assert "excluded from synchronisation" in first[0].reason and first[3] == ["head.bias", "head.weight"]
    decision, warned, find_unused, ignored = second
    assert "every parameter got a gradient" in decision.reason and decision.value is False
    assert warned == [] and find_unused is False and ignored == []


def test_torch_powersgd_state_with_auto_is_refused_before_training():
    with pytest.raises(ValueError, match=r"comm_hook='powersgd'"):
        SoloDDP(ddp_comm_hook=powerSGD_hook, ddp_comm_state=PowerSGDState(process_group=None))
    SoloDDP(find_unused_parameters=True, ddp_comm_hook=powerSGD_hook, ddp_comm_state=PowerSGDState(None))


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_powersgd_state_survives_a_late_switch(tmp_path):
    # The error feedback is carried over the re-wraps (the fast path, then True after the late step).
    torch.manual_seed(0)
    runs = compare_with_true(tmp_path, Combo(make_data(STEPS, branch_off=LATE)), comm_hook="powersgd",
                             powersgd_start_iter=2)  # fmt: skip
    assert runs["auto"][0]["wrappers"] == 3


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case",
    [
        # An averaging step leaves the branch without a gradient on rank 1 only: every rank must still average it.
        pytest.param(dict(accumulate=2, branch_off={10: (1,)}), id="unused_on_one_rank_with_accumulation"),
        # Frozen at step 8 while the replicas differ: the re-wrap must not broadcast rank 0's copy, and the
        # final average must still take the trunk, frozen or not.
        pytest.param(dict(freeze_at=8), id="layer_frozen_mid_fit"),
    ],
)
def test_post_local_sgd_equals_two_replicas_averaged(tmp_path, case):
    # Local steps from step 2 (outside DDP's reducer), averages after steps 2, 6, 10, 14 and at the end.
    torch.manual_seed(0)
    accumulate, freeze_at = case.get("accumulate", 1), case.get("freeze_at")
    net = Combo(make_data(STEPS, accumulate, branch_off=case.get("branch_off")))
    strategy = SoloDDP(start_method="fork", comm_hook="post_local_sgd", local_sgd_warmup=2, local_sgd_period=4)
    callbacks = [_FreezeAt(step=freeze_at)] if freeze_at is not None else []
    records = fit(tmp_path, net, strategy, accumulate=accumulate, callbacks=callbacks)
    assert_ranks_identical(records)
    expected = local_sgd_reference(net, warmup=2, period=4, accumulate=accumulate, freeze_at=freeze_at)
    assert max_rel_err(records[0], expected) <= TOL
    assert records[0]["wrappers"] == (2 if freeze_at is not None else 1)
