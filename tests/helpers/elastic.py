"""A worker that dies once: the fault an elastic test injects (``+callbacks.die._target_=tests.helpers.elastic.DieOnce``)."""

from __future__ import annotations

import os

import lightning as L
from typing_extensions import override


class DieOnce(L.Callback):
    """Kill this process (``os._exit``, no cleanup, as a crash) on global rank ``rank`` when ``step`` optimizer
    steps are done, once per ``marker`` file (created first, in the working directory): torchrun's restart
    counters are per node, so a rank landing on another node after the restart could not tell it already died."""

    def __init__(self, rank: int = 1, step: int = 3, marker: str = "died_once") -> None:
        self.rank, self.step, self.marker = rank, step, marker

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            try:
                open(self.marker, "x").close()
            except FileExistsError:
                return
            print(f"DieOnce: rank {self.rank} exits at step {self.step}", flush=True)
            os._exit(3)
