"""ConfigFingerprint: every rank must train the configuration rank 0 trains. See docs/diagnostics.md."""

from __future__ import annotations

import hashlib

import lightning as L
import torch
from typing_extensions import override


class ConfigMismatchError(RuntimeError):
    """The ranks composed different configurations."""


class ConfigFingerprint(L.Callback):
    """Compares a hash of ``resolved_config`` across ranks at setup; a difference raises on every rank."""

    def __init__(self, resolved_config: str) -> None:
        digest = hashlib.sha256(resolved_config.encode()).digest()
        self.fingerprint = int.from_bytes(digest[:8], "little", signed=True)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size < 2:
            return
        mine = torch.tensor([self.fingerprint], dtype=torch.int64, device=trainer.strategy.root_device)
        every = trainer.strategy.all_gather(mine).flatten().tolist()
        differ = [rank for rank, value in enumerate(every) if value != every[0]]
        if differ:
            raise ConfigMismatchError(
                f"rank(s) {differ} composed a different configuration than rank 0. Look for interpolations "
                "that resolve per process (${now:...}, ${oc.env:...}, custom resolvers) outside hydra.run.dir."
            )
