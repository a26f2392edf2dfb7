"""The equivalence harness: a small regression LightningModule (:class:`Net`), its data, a fit on 2 CPU ranks
through SoloDDP's fork launcher with a per-rank :class:`Record`, and the 1-process reference it must match.

Each rank shards the data with ``DistributedSampler(shuffle=False)`` (Lightning's own sampler always shuffles
the training set), so that the union of the ranks' batches at step k is the single process's batch k. The
model has no BatchNorm. Used by tests/test_equivalence.py, tests/test_unused.py and
tests/test_unused_combinations.py.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.helpers.modules import TinyModule
from tests.helpers.records import RankRecorder, read_rank_records

TOL = 1e-5
BATCH = 4  # per rank
STEPS = 16  # > the evidence window (4) + one event-check period (8)
LR = 0.05
# Weight decay tells a parameter left without a gradient (None: untouched) from one given a zero gradient.
WEIGHT_DECAY = 0.1


class Net(TinyModule):
    """TinyModule ``(8, 16, 1)`` (``batchnorm``: with BatchNorm) under MSE and SGD with weight decay, on the
    data given. ``variant``:

    * ``"used"``: every parameter is used;
    * ``"head"``: plus a head that is never called (statically unused);
    * ``"branch"``: plus a branch applied per sample to the samples whose first feature is positive, so a
      batch without such samples leaves it unused (dynamically, per rank and per step). Per-sample, hence
      the same function of the data however the batch is split between ranks.
    """

    def __init__(self, variant: str = "used", data: tuple[torch.Tensor, ...] | None = None, batchnorm=False):
        super().__init__((8, 16, 1), batchnorm=batchnorm, head=variant == "head", loss="mse", batch_size=BATCH,
                         lr=LR, weight_decay=WEIGHT_DECAY)  # fmt: skip
        self.variant, self.data = variant, data
        if variant == "branch":
            self.branch = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after_trunk(self.trunk(x), x)

    def after_trunk(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.variant == "branch":
            picked = (x[:, 0] > 0).nonzero().flatten()
            if len(picked):
                extra = torch.zeros_like(h)
                extra[picked] = self.branch(h[picked])
                h = h + extra
        return self.out(h)

    def train_dataloader(self):
        sampler = DistributedSampler(
            TensorDataset(*self.data), num_replicas=self.trainer.world_size, rank=self.trainer.global_rank,
            shuffle=False,
        )  # fmt: skip
        return DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)


def make_data(steps: int = STEPS, accumulate: int = 1, branch_off: dict[int, tuple[int, ...]] | None = None):
    """Inputs whose first feature is positive, except for the samples of the (step -> ranks) in
    ``branch_off``: those ranks' batches at that step leave the branch unused."""
    g = torch.Generator().manual_seed(0)
    n = 2 * BATCH * accumulate * steps
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
    x[:, 0] = x[:, 0].abs() + 0.1
    for step, ranks in (branch_off or {}).items():
        for rank in ranks:
            # DistributedSampler(shuffle=False) gives rank r the samples r, r + 2, r + 4, ...
            first = step * accumulate * BATCH
            idx = [2 * k + rank for k in range(first, first + accumulate * BATCH)]
            x[idx, 0] = -x[idx, 0]
    return x, y


def _ddp_settings(trainer, module) -> dict:
    ddp = trainer.strategy.model
    return {
        "find_unused_parameters": ddp.find_unused_parameters, "ignored": sorted(ddp.parameters_to_ignore),
        "comm_hook": ddp._get_ddp_logging_data().get("comm_hook"),
    }  # fmt: skip


class Record(RankRecorder):
    """Writes what each rank saw to ``rank{r}.json``: parameters, decisions, advice, the DDP wrapper of each
    batch, DDP's settings at the end of training, SoloDDP's warnings."""

    def __init__(self, path: Path):
        super().__init__(
            path,
            on_train_batch_start={"wrappers": "wrapper"},
            on_train_end={"ddp": _ddp_settings},
            on_fit_end={
                "params": "named_params", "decisions": "decisions",
                "advice": lambda trainer, module: getattr(trainer.strategy, "advice", []),
                "warnings": self._solo_warnings,
            },
        )  # fmt: skip

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self._catch = warnings.catch_warnings(record=True)
        self.warnings = self._catch.__enter__()
        warnings.simplefilter("always")

    def _solo_warnings(self, trainer, pl_module) -> list[str]:
        return [str(w.message) for w in self.warnings if "SoloDDP" in str(w.message)]

    def on_fit_end(self, trainer, pl_module):
        self._catch.__exit__(None, None, None)
        self.record["wrappers"] = len(set(self.record["wrappers"]))  # the DDP wrappers used
        super().on_fit_end(trainer, pl_module)


def fit(tmp_path: Path, net: Net, strategy, accumulate: int = 1, steps: int = STEPS, callbacks=()) -> list[dict]:
    """Fit a copy of ``net`` on 2 CPU ranks; return both ranks' records."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate,
        use_distributed_sampler=False, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
        callbacks=[Record(tmp_path), *callbacks],
    )  # fmt: skip
    trainer.fit(copy.deepcopy(net))
    return read_rank_records(tmp_path)


def reference(net: Net, accumulate: int = 1, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One process, batch 2B, the same steps (loss / accumulate, as Lightning does; grads reset to None)."""
    net = copy.deepcopy(net)
    x, y = net.data
    opt = torch.optim.SGD(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(steps):
        for micro in range(accumulate):
            start = 2 * BATCH * (step * accumulate + micro)
            (F.mse_loss(net(x[start : start + 2 * BATCH]), y[start : start + 2 * BATCH]) / accumulate).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().flatten() for n, p in net.named_parameters()}


def local_sgd_reference(
    net: Net, warmup: int, period: int, steps: int = STEPS, accumulate: int = 1, freeze_at: int | None = None
) -> dict[str, torch.Tensor]:
    """Post-local-SGD in one process: two replicas, each on its rank's samples (loss / accumulate). For the first
    ``warmup`` steps their gradients are averaged (a missing one counts as zero; missing on both stays missing),
    then each keeps its own. After step k >= warmup with (k - warmup) % period == 0 the trainable parameters
    are averaged, and at the end every parameter a local step trained. ``freeze_at``: the trunk is frozen from
    that step on."""
    replicas = [copy.deepcopy(net) for _ in range(2)]
    x, y = net.data
    optimizers = [
        torch.optim.SGD([p for p in r.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
        for r in replicas
    ]
    trained: set[str] = set()

    def average(names) -> None:
        with torch.no_grad():
            for (name, a), b in zip(replicas[0].named_parameters(), replicas[1].parameters()):
                if name in names:
                    a.copy_((a + b) / 2)
                    b.copy_(a)

    for step in range(steps):
        if step == freeze_at:
            for r in replicas:
                r.trunk.requires_grad_(False)
        for rank, r in enumerate(replicas):
            for micro in range(accumulate):
                first = (step * accumulate + micro) * BATCH
                idx = [2 * j + rank for j in range(first, first + BATCH)]  # DistributedSampler(shuffle=False)
                (F.mse_loss(r(x[idx]), y[idx]) / accumulate).backward()
        if step < warmup:
            for pair in zip(replicas[0].parameters(), replicas[1].parameters()):
                if grads := [p.grad for p in pair if p.grad is not None]:
                    for p in pair:
                        p.grad = sum(grads) / 2
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        trainable = {n for n, p in replicas[0].named_parameters() if p.requires_grad}
        if step >= warmup:
            trained |= trainable
            if (step - warmup) % period == 0:
                average(trainable)
    average(trained | {n for n, p in replicas[0].named_parameters() if p.requires_grad})
    return {n: p.detach().flatten() for n, p in replicas[0].named_parameters()}


def max_rel_err(record: dict, expected: dict[str, torch.Tensor]) -> float:
    errors = []
    for name, want in expected.items():
        got = torch.tensor(record["params"][name], dtype=torch.float64)
        errors.append(((got - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-12)).item())
    return max(errors)


def assert_ranks_identical(records: list[dict]) -> None:
    assert records[0]["params"] == records[1]["params"], "the ranks' parameters differ"
