"""Exact resume across one strategy's fits (:class:`ExactResume`, called from SoloDDP's hooks) and
``ckpt_path="auto"``. See docs/checkpoints.md."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo._compat.patch import Patches
from lightning_solo.checkpoint.io import load_weights_only
from lightning_solo.checkpoint.manifest import read_manifest
from lightning_solo.checkpoint.select import checkpoint_dir, decide_resume, hpc_checkpoints
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.resume import record as resume
from lightning_solo.ddp.resume.loader import make_resumable


# Lightning skips every restore step for a falsy checkpoint: "auto" that found nothing starts fresh.
class _NoCheckpoint(dict):
    def __bool__(self) -> bool:
        return False


NO_CHECKPOINT = _NoCheckpoint({"pytorch-lightning_version": lightning.__version__})


class ExactResume:
    """A strategy's exact-resume state and hooks; ``enabled=False``: Lightning's loaders and RNG streams, no record."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._record: dict[str, Any] | None = None  # read from the checkpoint, replayed by the next loaders
        self._plan: resume.ResumePlan | None = None
        self._loaders_open = False  # True while Lightning hands over the training loaders of one request
        self._train_loaders: list[Any] = []
        self._loader_decisions: list[Decision] = []
        self._in_optimizer_step = False
        self._last_step: tuple[dict[str, Any], int] | None = None  # (RNG, batches ready) at the last step
        self._step_buffers: dict[str, torch.Tensor] | None = None
        self._batch_end_rng: dict[str, Any] | None = None
        self._rng_before_first_batch: dict[str, Any] | None = None
        self._quiet = Patches()  # Lightning's warning silenced until the epoch loop's next reset

    def on_dataloader(self, dataloader: Any, trainer: Any, decide: Callable[[Decision], Any]) -> Any:
        """A training loader Lightning has processed: made resumable, and the resume plan attached to it."""
        if not self.enabled:
            decide(Decision(
                "resumable_data", False,
                "exact_resume=False: Lightning's own training loader and RNG streams; a mid-epoch resume restarts"
                " the epoch's data, as stock Lightning does",
            ))  # fmt: skip
            return dataloader
        if not self._loaders_open:  # Lightning processes each training loader in turn, then builds their iterators
            self._loaders_open, self._train_loaders, self._loader_decisions = True, [], []
            record, self._record = self._record, None
            self._plan = resume.ResumePlan(record, trainer, decide) if record is not None else None
            # Until this fit's first step, "the last step" is where it starts (a validation leaves the RNG there).
            ready = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
            plan_rng = self._plan.rng if self._plan is not None else None
            self._last_step = (plan_rng or resume.rng_state(), ready)
            self._batch_end_rng = self._last_step[0]
            self._step_buffers = resume.step_buffers(trainer)
        dataloader, decision = make_resumable(dataloader, seed=torch.initial_seed())
        self._train_loaders.append(dataloader)
        self._loader_decisions.append(decision)
        decide(_combined_decision(self._loader_decisions))
        if self._plan is not None:
            self._plan.attach(dataloader)
        return dataloader

    def close_loaders(self, trainer: Any) -> None:
        """Every training loader of the request is in: the resume plan settles (if no loader's first index did)."""
        if self._loaders_open:
            self._loaders_open = False
            plan, self._plan = self._plan, None
            if plan is not None:
                plan.settle()
                self._rng_before_first_batch = plan.rng_before_first_batch
                if plan.mid_epoch:
                    self._quiet = resume.quiet_not_resumable_warning(trainer)

    def step_hooks(self) -> dict[str, Callable[..., Any]]:
        """The training-step moments it takes part in (:mod:`lightning_solo.ddp.component`): none when off."""
        if not self.enabled:
            return {}
        return {
            "batch": self.before_batch,
            "step": self._around_training_step,
            "optimizer_step": self.stepping,
            "after_step": lambda strategy, optimizer: self.after_optimizer_step(strategy.lightning_module.trainer),
        }

    @contextlib.contextmanager
    def _around_training_step(self, strategy: Any) -> Iterator[None]:
        yield
        self.after_training_step()

    def before_batch(self, trainer: Any) -> None:
        """A training batch is about to move to the device."""
        self.close_loaders(trainer)  # (a reload of the loaders between epochs has no on_train_start)
        if (state := self._rng_before_first_batch) is not None:
            # The first resumed batch starts from the checkpoint's RNG, whatever Lightning did since the restore.
            self._rng_before_first_batch = None
            resume.set_rng_state(state)

    def after_training_step(self) -> None:
        """A batch that does not step (accumulation, manual optimization): a validation after it leaves the RNG here."""
        if self.enabled and not self._in_optimizer_step:
            self._batch_end_rng = resume.rng_state()

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around the optimizer step, whose closure runs the training step."""
        self._in_optimizer_step = True
        try:
            yield
        finally:
            self._in_optimizer_step = False

    def after_optimizer_step(self, trainer: Any) -> None:
        """The point a checkpoint's record describes, whenever the save happens before the next step."""
        if self.enabled:
            state = resume.rng_state()
            self._last_step = (state, int(trainer.fit_loop.epoch_loop.batch_progress.current.ready))
            self._batch_end_rng = state
            self._step_buffers = resume.step_buffers(trainer)

    def after_validation(self, trainer: Any) -> None:
        """A validation inside fit leaves the training RNG as the last training batch's work left it."""
        state = self._batch_end_rng
        if self.enabled and state is not None and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            resume.set_rng_state(state)

    def add_to_checkpoint(self, checkpoint: dict[str, Any], trainer: Any, collective: bool = True) -> None:
        """Put the resume record into ``checkpoint`` during fit. ``collective=False``: this rank's only."""
        if self.enabled and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            last_step = self._last_step
            checkpoint[resume.RESUME_KEY] = resume.capture(trainer, self._train_loaders, last_step, collective)
            resume.rewind_buffers(checkpoint, trainer, last_step, self._step_buffers)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The record the next training loaders replay."""
        self._record = checkpoint.get(resume.RESUME_KEY) if self.enabled else None

    def reset(self) -> None:
        """At teardown: no loaders left open for the next fit (one may have failed meanwhile), no patch left."""
        self._loaders_open, self._plan, self._rng_before_first_batch = False, None, None
        self._quiet.close()


def load_auto_checkpoint(strategy: Any, weights_only: bool | None) -> tuple[dict[str, Any], str | None]:
    """``fit(ckpt_path="auto")`` (a collective): rank 0's choice, checked on every rank; the checkpoint and its path
    (:data:`NO_CHECKPOINT`, ``None``: none). ``weights_only=None``: the checkpoint IO's setting (else ``True``)."""
    trainer, rank = strategy.lightning_module.trainer, strategy.global_rank
    if weights_only is None:
        weights_only = getattr(strategy.checkpoint_io, "weights_only", True)
    chosen: tuple[Any, Any] | None = None
    if rank == 0:
        decision = decide_resume(checkpoint_dir(trainer), extra=hpc_checkpoints(trainer))
        chosen = (decision, decision.value and read_manifest(decision.value))
    decision, manifest = strategy.broadcast(chosen, 0)  # rank 0 always sends a pair
    strategy._decide(decision)
    rank_zero_info(f"ckpt_path='auto': {decision}")
    path = decision.value
    if path is not None and read_manifest(path) != manifest:
        raise RuntimeError(
            f"rank {rank} does not see the checkpoint rank 0 chose for ckpt_path='auto'"
            f" ({path}): put the checkpoint directory on a filesystem all nodes share"
        )
    lightning_compat.set_ckpt_path(trainer, path)
    if path is None:
        return NO_CHECKPOINT, None
    # Verified (hashed) once, by rank 0's choice: loaded as is.
    return load_weights_only(path, map_location=lambda storage, loc: storage, weights_only=weights_only), path


def _combined_decision(decisions: list[Decision]) -> Decision:
    """One ``resumable_data`` Decision for the training loaders: exact only if every one is."""
    if len(decisions) == 1:
        return decisions[0]
    values = [d.value for d in decisions]
    value = False if False in values else "approximate" if "approximate" in values else True
    reasons = "; ".join(f"loader {i}: {d.reason}" for i, d in enumerate(decisions))
    return Decision("resumable_data", value, f"{len(decisions)} training loaders, {reasons}")
