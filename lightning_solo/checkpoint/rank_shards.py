"""State that differs per rank (PowerSGD's error feedback, post-local-SGD's replicas), kept beside a checkpoint as
one verified file per rank: ``write`` (a collective) and ``read``. See docs/checkpoints.md."""

import glob
import hashlib
import io
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

KINDS = ("powersgd", "local_sgd")


def shard_dir(checkpoint_path: Any, kind: str = "powersgd") -> str:
    """The folder of a checkpoint's shards of ``kind``; :func:`remove` takes every kind with the checkpoint."""
    return f"{os.fspath(checkpoint_path)}.{kind}"


def remove(checkpoint_path: Any) -> None:
    """Remove the shards of every kind that belong to ``checkpoint_path``."""
    for kind in KINDS:
        shutil.rmtree(shard_dir(checkpoint_path, kind), ignore_errors=True)


def write(checkpoint_path: Any, kind: str, state: Any) -> dict[str, Any]:
    """Write this rank's ``state`` beside ``checkpoint_path``; on every rank (a collective). Returns the record
    for the checkpoint: the folder's name and every rank's sha256."""
    digests: list[Any] = [None] * dist.get_world_size()
    stem = os.path.join(shard_dir(checkpoint_path, kind), f"rank{dist.get_rank()}")
    dist.all_gather_object(digests, _write_file(stem, state))
    return {"dir": os.path.basename(shard_dir(checkpoint_path, kind)), "sha256": digests}


def read(checkpoint_path: Any, record: dict[str, Any], rank: int, what: str, *, mmap: bool = True) -> Any:
    """``rank``'s shard, verified against ``record``'s sha256; a clear error naming the rank if it is missing or
    damaged. ``what`` names the state in that error."""
    if checkpoint_path is None:
        raise ValueError(f"the {what} is kept in per-rank files beside the checkpoint: pass checkpoint_path")
    # Beside the file itself (last.ckpt may be a link), under the name recorded when it was saved (or copied).
    folder = os.path.join(os.path.dirname(os.path.realpath(checkpoint_path)), record["dir"])
    digest = record["sha256"][rank]
    path = os.path.join(folder, f"rank{rank}.{digest[:16]}.pt")
    problem = None
    if not os.path.isfile(path):
        problem = "is missing"
    else:
        with open(path, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                problem = "does not match the sha256 the checkpoint recorded (damaged or from another save)"
    if problem:
        raise RuntimeError(
            f"{what} of rank {rank} for {os.fspath(checkpoint_path)!r}: {path!r} {problem}. Each rank's shard is "
            f"written beside the checkpoint, in {record['dir']!r}; copy that folder with the checkpoint, or "
            "resume from another checkpoint."
        )
    return torch.load(path, mmap=mmap, weights_only=True)


def _write_file(stem: str, state: Any) -> str:
    """Write atomically (temporary file, fsync, rename) and return the sha256 of the bytes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    digest = hashlib.sha256(data).hexdigest()
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    path = f"{stem}.{digest[:16]}.pt"
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # This rank's older shards for this path: the two newest stay (the file on disk may still be one of theirs).
    older = sorted((p for p in glob.glob(f"{glob.escape(stem)}.*.pt") if p != path), key=os.path.getmtime)
    for stale in older[:-2]:
        os.remove(stale)
    return digest
