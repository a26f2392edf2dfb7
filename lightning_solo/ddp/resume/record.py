"""Exact mid-epoch resume: the record a checkpoint carries, and the resume it decides (no sample repeated or skipped,
every rank's RNG back). See docs/checkpoints.md."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo._compat.patch import Patches
from lightning_solo.core import ranks
from lightning_solo.core.decision import Decision
from lightning_solo.core.rng import rng_state, set_rng_state  # re-exported: resume.rng_state() is public
from lightning_solo.ddp.resume.loader import ResumableSampler, SeededDataset

RESUME_KEY = "lightning_solo.resume"  # a checkpoint key (the format), not the module path


class _Packed(NamedTuple):
    """A CPU tensor as a numpy array, for ``all_gather_object`` (see :func:`capture`)."""

    array: Any


def _pack(obj: Any) -> Any:
    return apply_to_collection(obj, torch.Tensor, lambda t: _Packed(t.cpu().numpy()))


def _unpack(obj: Any) -> Any:
    return apply_to_collection(obj, _Packed, lambda p: torch.from_numpy(p.array))


def _sampler(loader: Any) -> ResumableSampler | None:
    sampler = getattr(loader, "sampler", None)
    return sampler if isinstance(sampler, ResumableSampler) else None


def _batches(loader: Any) -> int:
    try:
        return len(loader)
    except TypeError:
        return -1


def _sample_seed(loader: Any) -> int | None:
    # type(): a SeededDataset answers isinstance for the user's class, not the other way round.
    dataset = getattr(loader, "dataset", None)
    return dataset.seed if type(dataset) is SeededDataset else None


def capture(
    trainer: Any, loaders: list[Any], last_step: tuple[Any, int] | None, collective: bool = True
) -> dict[str, Any]:
    """The resume record of the training ``loaders`` at the last optimizer step (``last_step``: this rank's RNG state,
    batches consumed); a collective gathering every rank's RNG, unless ``collective=False`` (a resume restores none)."""
    world_size = ranks.world_size()
    samplers = [_sampler(loader) for loader in loaders]
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    state, consumed = last_step if last_step is not None else (rng_state(), int(progress.ready))
    epoch_rng = [s.epoch_rng if s is not None else None for s in samplers]
    local = (state, epoch_rng if any(e is not None for e in epoch_rng) else None)
    if world_size > 1 and collective:
        gathered: list[Any] = [None] * world_size
        # Numpy arrays: pickling a tensor would call torch.save on every rank while rank 0 saves the checkpoint.
        torch.distributed.all_gather_object(gathered, _pack(local))
        gathered = [_unpack(g) for g in gathered]
    else:
        gathered = [local]
    per_epoch = trainer.num_training_batches
    first = next((s for s in samplers if s is not None), None)
    record = {
        "epoch": first.epoch if first is not None else trainer.current_epoch,
        "consumed_batches": consumed,
        "batches_in_epoch": int(per_epoch) if per_epoch != float("inf") else -1,
        "batch_size": first.batch_size if first is not None else None,
        "world_size": world_size,
        "sample_seed": _sample_seed(loaders[0]) if loaders else None,
        "loaders": [
            {
                "epoch": s.epoch if s is not None else None,
                "batch_size": s.batch_size if s is not None else None,
                "batches": _batches(loader),
                "sample_seed": _sample_seed(loader),
            }
            for loader, s in zip(loaders, samplers)
        ],
        "rng": [g[0] for g in gathered],
    }
    if any(g[1] is not None for g in gathered):
        record["epoch_rng"] = [g[1] for g in gathered]
    return record


def step_buffers(trainer: Any) -> dict[str, torch.Tensor] | None:
    """The module's buffers right after an optimizer step, when accumulation can put a save between steps."""
    if trainer.accumulate_grad_batches <= 1:
        return None
    return {name: b.detach().clone() for name, b in trainer.lightning_module.named_buffers()}


def rewind_buffers(
    checkpoint: dict[str, Any], trainer: Any, last_step: tuple[Any, int] | None, buffers: dict[str, torch.Tensor] | None
) -> None:
    """Inside an accumulation cycle: the last optimizer step's buffers in the checkpoint (resumes rerun forwards)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    state = checkpoint.get("state_dict")
    if buffers is None or last_step is None or state is None or int(progress.ready) <= last_step[1]:
        return
    state.update({name: value for name, value in buffers.items() if name in state})


_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def quiet_not_resumable_warning(trainer: Any) -> Patches:
    """Silence Lightning's "dataloader is not resumable" warning for this trainer's epoch loop's next ``reset`` only."""
    loop, patches = trainer.fit_loop.epoch_loop, Patches()
    if "reset" in vars(loop):
        return patches
    reset = loop.reset

    def quiet_reset() -> None:
        patches.close()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
            reset()

    patches.set(loop, "reset", quiet_reset)
    return patches


_COUNTERS = ("ready", "started", "processed", "completed")


def _counters(trainer: Any) -> list[list[int]]:
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return [[getattr(c, name) for name in _COUNTERS] for c in (progress.current, progress.total)]


def _rewind(trainer: Any, restored: list[list[int]], batches: int) -> None:
    # Lightning's restored counters moved back by ``batches`` (from the restored values: settling twice is harmless).
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for counter, values in zip((progress.current, progress.total), restored):
        for name, value in zip(_COUNTERS, values):
            setattr(counter, name, max(0, value - batches))


def _position(mode: str | None, consumed: int, batches: int) -> int | None:
    """The batches of its current pass a loader has given after ``consumed`` batches of the combined epoch."""
    if batches <= 0:
        return None
    if mode == "max_size_cycle":  # a shorter loader starts over when it runs out
        return consumed % batches
    if mode == "max_size":  # a shorter loader stays exhausted
        return min(consumed, batches)
    if mode == "min_size":
        return consumed if consumed <= batches else None
    return None


class ResumePlan:
    """A checkpoint's record applied to this fit's training loaders (each given to :meth:`attach`); :meth:`settle`
    decides once all are in. This rank's RNG comes back at once at an epoch boundary, else right before the first
    resumed batch (:attr:`rng_before_first_batch`), after Lightning's fast-forward of a validation due then."""

    def __init__(self, record: dict[str, Any], trainer: Any, decide: Callable[[Decision], Any]) -> None:
        self.record, self.trainer, self._decide = record, trainer, decide
        self.loaders: list[Any] = []
        self.samplers: list[ResumableSampler | None] = []
        self.skips: list[int] = []
        rng = record.get("rng") or []
        self.rng = rng[ranks.rank()] if len(rng) == ranks.world_size() else None  # this rank's, if every rank's saved
        self.rng_before_first_batch: dict[str, Any] | None = None
        self.settled = self.decided = False
        self.restored = _counters(trainer)
        epoch, consumed, per_epoch = record["epoch"], record["consumed_batches"], record["batches_in_epoch"]
        loop_epoch = trainer.fit_loop.epoch_progress.current.processed
        ended = 0 < per_epoch <= consumed
        self.mid_epoch = consumed > 0 and not ended and loop_epoch == epoch
        # At a boundary: the epoch the resumed run trains first (a save after the epoch's last batch can come
        # before Lightning counts the epoch done).
        self.next_epoch = epoch + 1 if ended else loop_epoch
        if not self.mid_epoch and self.rng is not None:
            set_rng_state(self.rng)

    @property
    def rng_note(self) -> str:
        if self.rng is not None:
            return "RNG states restored"
        return f"RNG states not restored ({len(self.record.get('rng') or [])} saved, {ranks.world_size()} ranks)"

    def _saved_loader(self, i: int) -> dict[str, Any]:
        loaders = self.record.get("loaders")
        if loaders is None:  # a record from before several loaders were recorded: one loader
            loaders = [{"epoch": self.record["epoch"], "batch_size": self.record.get("batch_size"),
                        "batches": None, "sample_seed": self.record.get("sample_seed")}]  # fmt: skip
        return loaders[i] if i < len(loaders) else {}

    def attach(self, loader: Any) -> None:
        """The next training loader Lightning processed: arm its sampler (the skip is asked at its first index)."""
        i = len(self.samplers)
        sampler = _sampler(loader)
        self.loaders.append(loader)
        self.samplers.append(sampler)
        if sampler is not None:
            saved = self._saved_loader(i)
            if type(loader.dataset) is SeededDataset and saved.get("sample_seed") is not None:
                loader.dataset.seed = saved["sample_seed"]
            if not self.mid_epoch:
                # Persistent workers: the uninterrupted run reused their iterator, which draws no worker seed; here
                # it was just built, drawing one, so the RNG goes back after it.
                rng, persistent = self.rng, loader.persistent_workers and loader.num_workers > 0
                restore = functools.partial(set_rng_state, rng) if persistent and rng is not None else None
                sampler.resume_once(self.next_epoch, 0, on_start=restore)
            else:
                epoch_rng = self.record.get("epoch_rng")
                mine = epoch_rng[ranks.rank()] if epoch_rng and len(epoch_rng) == ranks.world_size() else None
                sampler.resume_once(
                    saved.get("epoch", self.record["epoch"]),
                    lambda: self._skip(i),
                    mine[i] if mine is not None and i < len(mine) else None,
                )
        self._settle(final=False)

    def _skip(self, i: int) -> int:
        self.settle()
        return self.skips[i] if i < len(self.skips) else 0

    def settle(self) -> None:
        """The final decision, once every loader is attached (and Lightning's ``CombinedLoader`` mode is known)."""
        if not self.settled:
            self.settled = True
            self._settle(final=True)

    def _settle(self, final: bool) -> None:
        """Decide every loader's position, rewind Lightning's counters to it and say so; provisionally after each
        :meth:`attach` (Lightning's default mode), so that callbacks' ``on_train_start`` sees a Decision."""
        if not self.mid_epoch:
            if not self.decided:
                self.decided = True
                self._decide(
                    Decision("mid_epoch_resume", 0, f"the checkpoint is at an epoch boundary; {self.rng_note}")
                )
            return
        self.rng_before_first_batch = self.rng
        record, world_size = self.record, ranks.world_size()
        epoch, consumed = record["epoch"], record["consumed_batches"]
        ready = self.restored[0][0]  # this epoch's batches Lightning restored
        # One loader: the mode does not matter. Several: Lightning's CombinedLoader is known at the final call only.
        mode = (
            lightning_compat.combined_loader_mode(self.trainer) if final and len(self.samplers) > 1 else None
        ) or "max_size_cycle"
        saved = [self._saved_loader(i) for i in range(len(self.samplers))]
        now_sizes = [s.batch_size if s is not None else None for s in self.samplers]
        restart = None
        if record.get("world_size") != world_size or [s.get("batch_size") for s in saved] != now_sizes:
            restart = (
                f"saved with {record.get('world_size')} ranks x batch {record.get('batch_size')}, now"
                f" {world_size} x {now_sizes[0] if len(now_sizes) == 1 else now_sizes}: the shards differ"
            )
        elif "loaders" in record and len(record["loaders"]) != len(self.samplers):
            restart = f"saved with {len(record['loaders'])} training loaders, now {len(self.samplers)}"
        batches = [_batches(loader) for loader in self.loaders]
        if restart is None and any(s.get("batches") not in (None, b) for s, b in zip(saved, batches)):
            restart = f"saved with loaders of {[s.get('batches') for s in saved]} batches, now {batches}"
        positions = [_position(mode, consumed, b) if s is not None else 0 for s, b in zip(self.samplers, batches)]
        if restart is None and None in positions:
            restart = f"CombinedLoader mode {mode!r} with loaders of {batches} batches"
        if restart is not None:
            _rewind(self.trainer, self.restored, ready)
            self.skips = [0] * len(self.samplers)
            self._decide(Decision(
                "mid_epoch_resume", 0,
                f"{restart}, so epoch {epoch} restarts in full (its first {consumed} batches per old rank are"
                f" trained again); {self.rng_note}",
            ))  # fmt: skip
            return
        replay = ready - consumed
        _rewind(self.trainer, self.restored, replay)
        self.skips = [
            p * s.batch_size if s is not None and p is not None else 0  # (no None p here: it restarted)
            for p, s in zip(positions, self.samplers)
        ]
        notes = []
        if len(self.samplers) > 1:
            notes.append(f"{len(self.samplers)} loaders ({mode}) at batches {positions} of their passes")
        restarting = [i for i, s in enumerate(self.samplers) if s is None]
        if restarting:
            notes.append(f"training loader(s) {restarting} cannot skip and restart their epoch")
        if replay > 0:
            notes.append(
                f"the checkpoint was written {replay} batch(es) into an accumulation cycle: it holds the state of the"
                " last optimizer step and those batches are trained again"
            )
        self._decide(Decision(
            "mid_epoch_resume", consumed,
            f"epoch {epoch} continues after the {consumed} batches already trained on; {self.rng_note}"
            + "".join(f"; {note}" for note in notes),
        ))  # fmt: skip
