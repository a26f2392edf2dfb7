"""SoloDDP's exact-resume hooks: what a checkpoint carries beyond Lightning's, and how a fit continues from it.

A checkpoint holds the training loader's position and every rank's RNG as of the last optimizer step, and the
comm hook's state; ``fit(ckpt_path="auto")`` picks the newest verified checkpoint on rank 0. The logic lives in
:mod:`lightning_solo.resume` and :mod:`lightning_solo.checkpoint`; this class only calls it from Lightning's hooks.
"""

from __future__ import annotations

import os
from typing import Any

import lightning
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_solo import comm, resume
from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.checkpoint.io import load_weights_only
from lightning_solo.checkpoint.manifest import read_manifest
from lightning_solo.checkpoint.select import checkpoint_dir, decide_resume, hpc_checkpoints
from lightning_solo.resumable_loader import make_resumable
from lightning_solo.strategy.base import SoloStrategyBase


# Lightning skips every restore step for a falsy checkpoint: "auto" that found nothing starts fresh.
class _NoCheckpoint(dict):
    def __bool__(self) -> bool:
        return False


_NO_CHECKPOINT = _NoCheckpoint({"pytorch-lightning_version": lightning.__version__})


class ExactResumeHooks(SoloStrategyBase):
    """The checkpoint and loader hooks of :class:`~lightning_solo.strategy.SoloDDP` (not used on its own)."""

    # Exact mid-epoch resume (lightning_solo.resume): a resumable training loader, its position and every
    # rank's RNG as of the last optimizer step saved in each checkpoint (all ranks run save_checkpoint),
    # replayed after a restore.
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or not trainer.training:
            return dataloader
        dataloader, decision = make_resumable(dataloader, seed=torch.initial_seed())
        self._decide(decision)
        self._train_loader = dataloader
        record, self._resume_record = getattr(self, "_resume_record", None), None
        if (planned := resume.decide(record, trainer, dataloader)) is not None:
            self._decide(planned)
        # Until the first step of this fit, "the last step" is where it starts (a validation before it, e.g. in
        # a replayed accumulation cycle, must leave the RNG there too).
        ready = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        self._last_step = (resume.saved_rng(record) or resume.rng_state(), ready)
        self._step_buffers = resume.step_buffers(trainer)
        return dataloader

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)
        # The point a checkpoint's record describes, whenever the save happens before the next step.
        trainer = self.module.trainer
        self._last_step = (resume.rng_state(), int(trainer.fit_loop.epoch_loop.batch_progress.current.ready))
        self._step_buffers = resume.step_buffers(trainer)
        return output

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.module.trainer.state.fn == TrainerFn.FITTING:
            resume.validation_neutral(getattr(self, "_last_step", None))

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None
    ) -> None:
        self.add_resume_state(checkpoint, filepath=filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def add_resume_state(
        self, checkpoint: dict[str, Any], collective: bool = True, filepath: Any = None
    ) -> None:
        """Put the resume record and the comm-hook state into ``checkpoint``. ``collective=False`` (the save
        on an exception, which must not wait on other ranks): this rank's record and hook state only."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            last_step = getattr(self, "_last_step", None)
            checkpoint[resume.RESUME_KEY] = resume.capture(
                trainer, getattr(self, "_train_loader", None), last_step, collective
            )
            # Inside an accumulation cycle the forwards since the step moved buffers (BatchNorm's running
            # statistics) that the resume replays: save them as of the step, like everything else.
            resume.rewind_buffers(checkpoint, trainer, last_step, getattr(self, "_step_buffers", None))
        # A full checkpoint. Per-rank shards are a collective (rank 0 records every rank's): only with all.
        if "optimizer_states" in checkpoint and (collective or self._comm.name != "powersgd"):
            # Post-local-SGD between averages: each rank's own model and optimizer state, beside the checkpoint.
            replica = (
                {key: checkpoint[key] for key in ("state_dict", "optimizer_states")} if collective else None
            )
            if hook_state := self._comm.state_dict(filepath, replica):  # each rank writes its shard beside it
                checkpoint[comm.CHECKPOINT_KEY] = hook_state

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if os.fspath(checkpoint_path) == "auto":
            checkpoint_path = self._choose_auto_checkpoint()
            if checkpoint_path is None:
                return _NO_CHECKPOINT
            checkpoint = load_weights_only(
                checkpoint_path,
                map_location=lambda storage, loc: storage,
                weights_only=getattr(self.checkpoint_io, "weights_only", True)
                if weights_only is None
                else weights_only,
            )
        else:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume_record = checkpoint.get(resume.RESUME_KEY)
        # Applied when the hook is registered; each rank reads its own shard beside the checkpoint.
        self._comm.load_state_dict(checkpoint.get(comm.CHECKPOINT_KEY), checkpoint_path)
        if (replica := self._comm.take_replica()) is not None:
            # Post-local-SGD saved between averages: this rank resumes its own model and optimizer state, which
            # Lightning restores from here (the model before DDP wraps it: see GradientCommHooks._setup_model).
            checkpoint.update(replica)
            self._own_replica_restored = True
        return checkpoint

    def _choose_auto_checkpoint(self) -> str | None:
        """``fit(ckpt_path="auto")``: rank 0 picks the newest checkpoint in the checkpoint callback's directory
        that verifies (hashing it once) and broadcasts it; every rank checks it sees the same file."""
        trainer = self.module.trainer
        chosen: tuple[Any, Any] | None = None
        if self.global_rank == 0:
            decision = decide_resume(checkpoint_dir(trainer), extra=hpc_checkpoints(trainer))
            chosen = (decision, decision.value and read_manifest(decision.value))
        decision, manifest = self.broadcast(chosen, src=0)  # type: ignore[misc]  # rank 0 always sends a pair
        self._decide(decision)
        rank_zero_info(f"ckpt_path='auto': {decision}")
        if decision.value is not None and read_manifest(decision.value) != manifest:
            raise RuntimeError(
                f"rank {self.global_rank} does not see the checkpoint rank 0 chose for ckpt_path='auto'"
                f" ({decision.value}): put the checkpoint directory on a filesystem all nodes share"
            )
        lightning_compat.set_ckpt_path(trainer, decision.value)
        return decision.value
