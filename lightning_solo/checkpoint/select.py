"""Choosing the checkpoint to resume from: the newest in a directory that verifies (``resume=auto``,
``ckpt_path="auto"``), as a Decision that says which newer ones were passed over and why."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_solo.checkpoint.io import _TMP_MARK
from lightning_solo.checkpoint.manifest import CheckpointVerificationError, read_manifest, verify
from lightning_solo.checkpoint.sharded import is_sharded, read_sharded_manifest, verify_sharded
from lightning_solo.core.decision import Decision


def _candidates(dirpath: str | os.PathLike) -> list[Path]:
    directory = Path(dirpath)
    if not directory.is_dir():
        return []
    return [
        p
        for p in directory.iterdir()
        if p.suffix == ".ckpt" and (p.is_file() or is_sharded(p)) and _TMP_MARK not in p.name
    ]


def _read(path: Path) -> dict | None:
    return read_sharded_manifest(path) if path.is_dir() else read_manifest(path)


def _verify(path: Path) -> dict:
    return verify_sharded(path) if path.is_dir() else verify(path)


def decide_resume(
    dirpath: str | os.PathLike | None,
    include_exception: bool = False,
    extra: Iterable[str | os.PathLike] = (),
) -> Decision:
    """The newest checkpoint in ``dirpath`` or ``extra`` that verifies (by step, then time), and why newer ones were
    passed over; one written during an exception (maybe mid-step) only with ``include_exception=True``."""
    extra_paths = [Path(p) for p in extra]
    if dirpath is None and not extra_paths:
        return Decision("resume", None, "no checkpoint directory is configured; starting fresh")
    skipped: list[str] = []
    ranked = []
    found = [*(_candidates(dirpath) if dirpath is not None else []), *extra_paths]
    for path in dict.fromkeys(p.resolve() for p in found):  # an hpc_ckpt may sit in the directory too
        manifest = _read(path)
        if manifest is None:
            try:
                _verify(path)  # fails; it says why
            except CheckpointVerificationError as err:
                skipped.append(f"{path.name}: {err.reason}")
        elif manifest.get("trigger") == "exception" and not include_exception:
            skipped.append(f"{path.name}: written during an exception")
        else:
            step = manifest.get("global_step")
            ranked.append(((step if isinstance(step, int) else -1, manifest.get("created", 0.0)), path))
    for _, path in sorted(ranked, key=lambda item: item[0], reverse=True):
        try:
            manifest = _verify(path)
        except CheckpointVerificationError as err:
            skipped.append(f"{path.name}: {err.reason}")
            continue
        reason = f"newest checkpoint that verifies (global step {manifest.get('global_step')})"
        if skipped:
            reason += "; passed over " + "; ".join(skipped)
        return Decision("resume", str(path), reason)
    where = os.fspath(dirpath) if dirpath is not None else "the SLURM checkpoints"
    reason = f"no checkpoint in {where!r} verifies; starting fresh"
    if skipped:
        reason += " (" + "; ".join(skipped) + ")"
    return Decision("resume", None, reason)


def find_latest_valid(dirpath: str | os.PathLike | None, include_exception: bool = False) -> str | None:
    """Path of the newest checkpoint in ``dirpath`` that verifies, or ``None``."""
    return decide_resume(dirpath, include_exception).value


def checkpoint_dir(trainer) -> str | None:
    """The first checkpoint callback's directory: where ``resume=auto`` and ``ckpt_path="auto"`` look."""
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None):
            return str(callback.dirpath)
    return None


def hpc_checkpoints(trainer) -> list[Path]:
    """The ``hpc_ckpt_<n>.ckpt`` files (SLURM requeue's) in ``default_root_dir``: candidates for ``resume=auto``."""
    return sorted(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"))


def resolve_ckpt_path(
    ckpt_path: str | os.PathLike | None,
    dirpath: str | os.PathLike | None,
    extra: Iterable[str | os.PathLike] = (),
) -> str | None:
    """The runner's ``resume`` as ``Trainer.fit(ckpt_path=...)``: ``"auto"``: the newest checkpoint in ``dirpath`` (or
    ``extra``) that verifies, or ``None`` (logged); anything else as it is (Lightning's ``"last"``/``"best"`` too)."""
    if ckpt_path is None or os.fspath(ckpt_path) != "auto":
        return None if ckpt_path is None else os.fspath(ckpt_path)
    decision = decide_resume(dirpath, extra=extra)
    rank_zero_info(f"resume=auto: {decision}")
    return decision.value
