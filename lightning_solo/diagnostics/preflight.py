"""Preflight: every rank checks its launch, its peers and its training setup. See docs/diagnostics.md."""

from __future__ import annotations

import os
from collections.abc import Sequence

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_solo.core.checks import check_bool, check_int
from lightning_solo.core.cluster import PreflightError
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.diagnostics.checks import agreement
from lightning_solo.diagnostics.checks.collectives import gather_objects
from lightning_solo.diagnostics.checks.facts import RankFacts, local_facts
from lightning_solo.diagnostics.checks.finding import Finding, merge
from lightning_solo.diagnostics.checks.launch_env import check_backend, check_launch_env
from lightning_solo.diagnostics.checks.setup_checks import check_setup, read_setup


class Preflight(DecisionLog, L.Callback):
    """Checks the launch, the ranks' agreement and the training setup (arguments: docs/diagnostics.md)."""

    def __init__(self, strict: bool = False, ignore: Sequence[str] = (), min_gpu_batch: int = 16) -> None:
        self.strict = check_bool("strict", strict)
        self.ignore = tuple(ignore)
        self.min_gpu_batch = check_int("min_gpu_batch", min_gpu_batch)
        self.decisions: dict[str, Decision] = {}
        self.findings: list[Finding] = []
        self.advice: list[str] = []
        self.facts: list[RankFacts] = []
        self._checked = ""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.findings, self.advice = [], []
        device = trainer.strategy.root_device
        backend = getattr(trainer.strategy, "process_group_backend", None) if trainer.world_size > 1 else None
        mismatch = check_backend(backend, device.type)
        if mismatch is not None and mismatch.error:  # before the gather: it would fail on this backend
            raise PreflightError(f"preflight: {mismatch}")
        placement = {
            "RANK": trainer.global_rank,
            "WORLD_SIZE": trainer.world_size,
            "LOCAL_RANK": trainer.local_rank,
            "NODE_RANK": trainer.node_rank,
            "GROUP_RANK": trainer.node_rank,
        }
        gpus = torch.cuda.device_count() if device.type == "cuda" else None
        local = check_launch_env(os.environ, placement=placement, gpus_visible=gpus)
        self.facts = gather_objects(local_facts(device, [*local, *([mismatch] if mismatch else [])]))
        self._settle(agreement.check(self.facts, self.ignore))
        shared = self.facts[0].shared
        gpu = f", CUDA {shared['cuda']}, NCCL {shared['nccl']}, driver {shared['driver']}" if shared["driver"] else ""
        self._checked = (
            f"{len(self.facts)} rank(s) agree on torch {shared['torch']}, lightning {shared['lightning']}, "
            f"device {shared['device']}{gpu}; launch variables and backend {backend or '-'} checked"
        )
        self._record()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        mine = check_setup(read_setup(trainer, self.min_gpu_batch))
        self._settle(merge(enumerate(gather_objects(mine))))
        self._checked += "; training setup checked"
        self._record()

    def _record(self) -> None:
        verdict = f"{len(self.findings)} warning(s)" if self.findings else "passed"
        self._decide(Decision("preflight", verdict, self._checked))

    def _settle(self, found: list[Finding]) -> None:
        """Raise on every rank (all hold the same ``found``) for errors, or any finding when strict; else warn."""
        stop = [f for f in found if f.error or self.strict]
        if stop:
            lines = "\n".join(f"  - {f}" for f in stop)
            raise PreflightError(f"preflight failed ({len(stop)} problem(s)):\n{lines}")
        for f in found:
            self.findings.append(f)
            self.advice.append(str(f))
            rank_zero_warn(f"lightning_solo preflight: {f}")
