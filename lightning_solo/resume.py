"""Exact mid-epoch resume: the record a checkpoint carries, and the resume it decides (no sample repeated or
skipped, every rank's RNG back).

Lightning restores the loop counters of a mid-epoch checkpoint but restarts the training dataloader
from the first batch of the epoch (it warns "your dataloader is not resumable"), so the resumed epoch
repeats the batches already trained on and never reaches its last ones; it saves no RNG state either.
SoloDDP closes the gap with the pieces below, so nothing changes for the data modules:

* ``make_resumable`` wraps the training loader's sampler (Lightning's ``DistributedSampler``, whose
  order is a function of seed and epoch) in a :class:`ResumableSampler`;
* ``capture`` (every rank, inside ``trainer.save_checkpoint``) records the sampler epoch, the batches
  of this epoch already trained on and every rank's RNG states into ``checkpoint[RESUME_KEY]``;
* ``decide`` turns that record, after Lightning restored its loops, into "epoch e, skip k batches, then
  restore this rank's RNG", applied at the first index the resumed epoch draws.

The loader side (:class:`ResumableSampler`, :class:`SeededDataset`, ``make_resumable``) is
:mod:`lightning_solo.resumable_loader`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_solo import ranks
from lightning_solo.decision import Decision
from lightning_solo.resumable_loader import ResumableSampler, SeededDataset
from lightning_solo.rng import rng_state, set_rng_state  # re-exported: resume.rng_state() is public

RESUME_KEY = "lightning_solo.resume"


# ---------------------------------------------------------------------------------------------------------
# save and restore the position


def capture(
    trainer: Any, loader: Any, last_step: tuple[dict[str, Any], int] | None, collective: bool = True
) -> dict[str, Any]:
    """The resume record; call on every rank (it gathers the RNG states of all ranks to each), or with
    ``collective=False`` on one rank (only its own RNG state: a resume then restores none).

    ``last_step`` is this rank's RNG state and the batches of the epoch consumed, taken right after the last
    optimizer step: the record is the state as of that step. A save in the middle of an accumulation cycle
    therefore holds no half-accumulated gradients (the weights and optimizer have not moved since that step);
    the resume replays the cycle's batches with the same RNG. A validation after the step does not count: SoloDDP
    puts the RNG back after it (:func:`validation_neutral`), so the resumed run, which skips it, matches.
    """
    world_size = ranks.world_size()
    sampler = getattr(loader, "sampler", None)
    sampler = sampler if isinstance(sampler, ResumableSampler) else None
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    local, consumed = last_step if last_step is not None else (rng_state(), int(progress.ready))
    if world_size > 1 and collective:
        gathered: list[Any] = [None] * world_size
        torch.distributed.all_gather_object(gathered, local)
    else:
        gathered = [local]
    per_epoch = trainer.num_training_batches
    dataset = getattr(loader, "dataset", None)
    return {
        "epoch": sampler.epoch if sampler is not None else trainer.current_epoch,
        "consumed_batches": consumed,
        "batches_in_epoch": int(per_epoch) if per_epoch != float("inf") else -1,
        "batch_size": sampler.batch_size if sampler is not None else None,
        "world_size": world_size,
        "sample_seed": dataset.seed if isinstance(dataset, SeededDataset) else None,
        "rng": gathered,
    }


def step_buffers(trainer: Any) -> dict[str, torch.Tensor] | None:
    """The module's buffers right after an optimizer step, when accumulation can put a save between steps
    (a copy per step of buffers only: BatchNorm statistics, small)."""
    if trainer.accumulate_grad_batches <= 1:
        return None
    return {name: b.detach().clone() for name, b in trainer.lightning_module.named_buffers()}


def rewind_buffers(
    checkpoint: dict[str, Any],
    trainer: Any,
    last_step: tuple[dict[str, Any], int] | None,
    buffers: dict[str, torch.Tensor] | None,
) -> None:
    """In a checkpoint written inside an accumulation cycle, put back the buffers of the last optimizer step
    (the resume replays the cycle's forwards, which would move them a second time)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    state = checkpoint.get("state_dict")
    if buffers is None or last_step is None or state is None or int(progress.ready) <= last_step[1]:
        return
    state.update({name: value for name, value in buffers.items() if name in state})


def saved_rng(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """This rank's RNG state in ``record``, if the record holds one for every rank."""
    rng = (record or {}).get("rng") or []
    world_size = ranks.world_size()
    return rng[ranks.rank()] if len(rng) == world_size else None


def validation_neutral(last_step: tuple[dict[str, Any], int] | None) -> None:
    """After a validation inside a fit: the RNG as it was after the last optimizer step (validation draws, e.g.
    its DataLoader's worker seed, must not shift the training stream: a resumed run skips that validation)."""
    if last_step is not None:
        set_rng_state(last_step[0])


def _rewind(trainer: Any, batches: int) -> None:
    # Lightning's restored batch counters, moved back to the batches this resume really continues after.
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for counter in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            setattr(counter, name, max(0, getattr(counter, name) - batches))


def decide(record: dict[str, Any] | None, trainer: Any, loader: Any) -> Decision | None:
    """Arm the loader's sampler to continue where ``record`` left off (call once Lightning restored its loops)."""
    if record is None:
        return None
    sampler = getattr(loader, "sampler", None)
    sampler = sampler if isinstance(sampler, ResumableSampler) else None
    saved = saved_rng(record)
    restore = (lambda: set_rng_state(saved)) if saved is not None else None
    rng, world_size = record.get("rng") or [], ranks.world_size()
    rng_note = (
        "RNG states restored"
        if restore
        else f"RNG states not restored ({len(rng)} saved, {world_size} ranks)"
    )
    if sampler is None:
        if restore is not None:
            restore()
        return Decision("mid_epoch_resume", False, "the training sampler is not resumable; " + rng_note)
    if isinstance(loader.dataset, SeededDataset) and record.get("sample_seed") is not None:
        loader.dataset.seed = record["sample_seed"]
    epoch, consumed, per_epoch = record["epoch"], record["consumed_batches"], record["batches_in_epoch"]
    mid_epoch = consumed > 0 and (per_epoch < 0 or consumed < per_epoch)
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    loop_epoch = trainer.fit_loop.epoch_progress.current.processed
    if not mid_epoch or loop_epoch != epoch:
        # At a boundary the uninterrupted run built the next epoch's DataLoader iterator after the save, which
        # drew its worker seed from the RNG, unless persistent workers reuse the iterator. Here it is built
        # right after this call: restore before it, or at the first index (after it) to skip that draw.
        persistent = loader.persistent_workers and loader.num_workers > 0
        if restore is not None and not persistent:
            restore()
        elif restore is not None:
            sampler.resume_once(None, 0, restore)
        return Decision("mid_epoch_resume", 0, f"the checkpoint is at an epoch boundary; {rng_note}")
    # Lightning's "your dataloader is not resumable" warning is about the loader it restarts; this one resumes.
    warnings.filterwarnings(
        "ignore", message="You're resuming from a checkpoint that ended before the epoch ended"
    )
    if record.get("world_size") != world_size or record.get("batch_size") != sampler.batch_size:
        _rewind(trainer, progress.ready)
        sampler.resume_once(epoch, 0, restore)
        return Decision(
            "mid_epoch_resume",
            0,
            f"saved with {record.get('world_size')} ranks x batch {record.get('batch_size')}, now"
            f" {world_size} x {sampler.batch_size}: the shards differ, so epoch {epoch} restarts in full"
            f" on the new shards (its first {consumed} batches per old rank are trained again); {rng_note}",
        )
    replay = progress.ready - consumed
    _rewind(trainer, replay)
    sampler.resume_once(epoch, consumed * sampler.batch_size, restore)
    note = (
        f"; the checkpoint was written {replay} batch(es) into an accumulation cycle: it holds the state of the"
        " last optimizer step and those batches are trained again"
        if replay > 0
        else ""
    )
    return Decision(
        "mid_epoch_resume",
        consumed,
        f"epoch {epoch} continues after the {consumed} batches already trained on; {rng_note}{note}",
    )
