"""SoloDDP's exact-resume hooks: what a checkpoint carries beyond Lightning's, and how a fit continues from it.

A checkpoint holds the training loader's position and every rank's RNG as of the last optimizer step, and the
comm hook's state; ``fit(ckpt_path="auto")`` picks the newest verified checkpoint on rank 0. The logic lives in
:mod:`lightning_solo.ddp.resume.record` and :mod:`lightning_solo.checkpoint`; this class only calls it from Lightning's hooks.
"""

from __future__ import annotations

import os
from typing import Any

import lightning
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.checkpoint.io import load_weights_only
from lightning_solo.checkpoint.manifest import read_manifest
from lightning_solo.checkpoint.select import checkpoint_dir, decide_resume, hpc_checkpoints
from lightning_solo.core.decision import Decision
from lightning_solo.ddp import comm
from lightning_solo.ddp._base import SoloStrategyBase
from lightning_solo.ddp.resume import record as resume
from lightning_solo.ddp.resume.loader import make_resumable


# Lightning skips every restore step for a falsy checkpoint: "auto" that found nothing starts fresh.
class _NoCheckpoint(dict):
    def __bool__(self) -> bool:
        return False


_NO_CHECKPOINT = _NoCheckpoint({"pytorch-lightning_version": lightning.__version__})


class ExactResumeHooks(SoloStrategyBase):
    """The checkpoint and loader hooks of :class:`~lightning_solo.ddp.strategy.SoloDDP` (not used on its own).

    With ``exact_resume=False`` (``self._exact_resume``) the training loaders and RNG streams stay Lightning's:
    no loader wrap, no resume record, validation draws shift the training RNG as they do stock."""

    _resume_record: dict[str, Any] | None = None
    _resume_plan: resume.ResumePlan | None = None
    _loaders_open = False  # True while Lightning hands over the training loaders of one request, one by one
    _in_optimizer_step = False
    _batch_end_rng: dict[str, Any] | None = None
    _rng_before_first_batch: dict[str, Any] | None = None

    @property
    def _exact(self) -> bool:
        return getattr(self, "_exact_resume", True)

    # Exact mid-epoch resume (lightning_solo.ddp.resume.record): resumable training loaders, their position and every
    # rank's RNG as of the last optimizer step saved in each checkpoint (all ranks run save_checkpoint),
    # replayed after a restore.
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or not trainer.training:
            return dataloader
        if not self._exact:
            self._decide(Decision(
                "resumable_data", False,
                "exact_resume=False: Lightning's own training loader and RNG streams; a mid-epoch resume restarts"
                " the epoch's data, as stock Lightning does",
            ))  # fmt: skip
            return dataloader
        first = not self._loaders_open
        if first:  # Lightning processes each training loader in turn, then builds their iterators
            self._loaders_open, self._train_loaders, self._loader_decisions = True, [], []
            record, self._resume_record = self._resume_record, None
            self._resume_plan = (
                resume.ResumePlan(record, trainer, self._decide) if record is not None else None
            )
            # Until the first step of this fit, "the last step" is where it starts (a validation before it, e.g.
            # in a replayed accumulation cycle, must leave the RNG there too).
            ready = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
            plan_rng = self._resume_plan.rng if self._resume_plan is not None else None
            self._last_step = (plan_rng or resume.rng_state(), ready)
            self._batch_end_rng = self._last_step[0]
            self._step_buffers = resume.step_buffers(trainer)
        dataloader, decision = make_resumable(dataloader, seed=torch.initial_seed())
        self._train_loaders.append(dataloader)
        self._loader_decisions.append(decision)
        self._decide(_combined_decision(self._loader_decisions))
        if self._resume_plan is not None:
            self._resume_plan.attach(dataloader)
        return dataloader

    def _close_loaders(self) -> None:
        """Every training loader of the request is in: the resume plan settles (if no loader's first index did)."""
        if self._loaders_open:
            self._loaders_open = False
            plan = self._resume_plan
            if plan is not None:
                plan.settle()
                self._rng_before_first_batch = plan.rng_before_first_batch
                self._resume_plan = None
                if plan.mid_epoch:
                    resume.quiet_not_resumable_warning(self.module.trainer)

    @override
    def on_train_start(self) -> None:
        self._close_loaders()  # before the epoch loop reads the batch counters the plan rewinds
        super().on_train_start()

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.training and not trainer.sanity_checking:
            self._close_loaders()  # (a reload of the loaders between epochs has no on_train_start)
            if (state := self._rng_before_first_batch) is not None:
                # The first resumed batch starts from the RNG of the checkpoint's step, whatever Lightning did
                # since the restore (e.g. it built the loader of the validation it fast-forwards).
                self._rng_before_first_batch = None
                resume.set_rng_state(state)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self._exact and not self._in_optimizer_step:
            # A batch that does not step (accumulation, manual optimization): where a validation after it must
            # leave the RNG. (Inside an optimizer step, the step's own capture below is the batch's end.)
            self._batch_end_rng = resume.rng_state()
        return output

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_optimizer_step = True
        try:
            output = super().optimizer_step(*args, **kwargs)
        finally:
            self._in_optimizer_step = False
        if self._exact:
            # The point a checkpoint's record describes, whenever the save happens before the next step.
            trainer = self.module.trainer
            state = resume.rng_state()
            self._last_step = (state, int(trainer.fit_loop.epoch_loop.batch_progress.current.ready))
            self._batch_end_rng = state
            self._step_buffers = resume.step_buffers(trainer)
        return output

    @override
    def teardown(self) -> None:
        # A fit that failed while Lightning handed over its loaders must not leave them open for the next fit.
        self._loaders_open, self._resume_plan, self._rng_before_first_batch = False, None, None
        super().teardown()

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        trainer = self.module.trainer
        if self._exact and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            resume.validation_neutral(self._batch_end_rng)

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
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._exact:
            last_step = getattr(self, "_last_step", None)
            checkpoint[resume.RESUME_KEY] = resume.capture(
                trainer, getattr(self, "_train_loaders", []), last_step, collective
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
        self._resume_record = checkpoint.get(resume.RESUME_KEY) if self._exact else None
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


def _combined_decision(decisions: list[Decision]) -> Decision:
    """One ``resumable_data`` Decision for the training loaders: exact only if every one is."""
    if len(decisions) == 1:
        return decisions[0]
    values = [d.value for d in decisions]
    value = False if False in values else "approximate" if "approximate" in values else True
    reasons = "; ".join(f"loader {i}: {d.reason}" for i, d in enumerate(decisions))
    return Decision("resumable_data", value, f"{len(decisions)} training loaders, {reasons}")
