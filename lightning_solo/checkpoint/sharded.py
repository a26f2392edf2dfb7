"""Sharded checkpoints (torch distributed checkpoint, DCP): a directory written atomically (into a temporary one,
renamed on commit) and verified, synchronously or by DCP's ``async_save``. See docs/checkpoints.md."""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from lightning_solo.checkpoint.io import _TMP_MARK, SoloCheckpointIO, _fsync_dir
from lightning_solo.checkpoint.manifest import CheckpointVerificationError, read_manifest, verify

META = "meta.pt"  # Lightning's name for the non-tensor part (lightning.fabric.utilities.load._METADATA_FILENAME)
DCP_METADATA = ".metadata"


def is_sharded(path: str | os.PathLike) -> bool:
    """A directory with DCP's ``.metadata``: a sharded checkpoint (complete or not)."""
    return os.path.isfile(os.path.join(path, DCP_METADATA))


def save_sharded(
    state: dict[str, Any],
    meta: dict[str, Any],
    path: str | os.PathLike,
    rank: int,
    barrier: Callable[[], None],
    io: SoloCheckpointIO | None = None,
    group: Any = None,
) -> tuple[Future, Callable[[], None]] | None:
    """Collective: every rank writes its shards of ``state`` into a temporary directory; rank 0 adds ``meta`` (with
    a manifest) and renames it to ``path`` (the same on all ranks). With a gloo ``group``, DCP's ``async_save``
    copies the state and writes it on a thread (its collectives on ``group``): returns its future and the commit."""
    import torch.distributed.checkpoint as dcp

    path = Path(path).absolute()
    tmp = path.parent / f".{path.name}{_TMP_MARK}dir"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        tmp.mkdir(parents=True)
    barrier()
    if group is not None:
        future: Any = dcp.async_save(state, checkpoint_id=tmp, process_group=group)
        meta = copy.deepcopy(meta)

        def commit() -> None:
            future.result()  # rank 0's ends after every rank's shards and the .metadata are written
            if rank == 0:
                _commit(meta, tmp, path, io)

        return future, commit
    dcp.save(state, checkpoint_id=tmp)
    barrier()
    if rank == 0:
        _commit(meta, tmp, path, io)
    barrier()
    return None


def _commit(meta: dict[str, Any], tmp: Path, path: Path, io: SoloCheckpointIO | None) -> None:
    (io or SoloCheckpointIO()).save_checkpoint(meta, tmp / META, storage_options={"sharded": True})
    _fsync_dir(str(tmp))
    old = path.parent / f".{path.name}{_TMP_MARK}old"
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)  # a directory cannot be replaced in one step: old aside, new in, old away
    os.replace(tmp, path)
    _fsync_dir(str(path.parent))
    shutil.rmtree(old, ignore_errors=True)


def read_sharded_manifest(path: str | os.PathLike) -> dict[str, Any] | None:
    """``meta.pt``'s manifest when ``path`` is a sharded checkpoint, else ``None`` (cheap: no hashing)."""
    return read_manifest(Path(path) / META) if is_sharded(path) else None


def verify_sharded(path: str | os.PathLike) -> dict[str, Any]:
    """``meta.pt``'s manifest once it and every shard ``.metadata`` names check; else CheckpointVerificationError."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if not is_sharded(path):
        raise CheckpointVerificationError(path, f"not a sharded checkpoint (no {DCP_METADATA})")
    manifest = verify(path / META)
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as err:  # any unreadable .metadata means a damaged checkpoint
        raise CheckpointVerificationError(path, f"{DCP_METADATA} does not load ({err})") from err
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        shard = path / name
        if not shard.is_file() or shard.stat().st_size < size:
            raise CheckpointVerificationError(path, f"shard {name} is missing or shorter than {size} bytes")
    return manifest
