"""SoloCheckpointIO: checkpoints that are either the old complete file or the new complete file, never
half of one, and that prove it when they are read back.

Example::

    import lightning as L
    from lightning_solo import SoloDDP
    from lightning_solo.checkpoint_io import SoloCheckpointIO, resolve_ckpt_path, verify

    trainer = L.Trainer(strategy=SoloDDP())          # SoloCheckpointIO is SoloDDP's default
    trainer.fit(model, ckpt_path=resolve_ckpt_path("auto", "outputs/checkpoints"))
    verify("outputs/checkpoints/last.ckpt")          # -> the manifest, or CheckpointVerificationError

A save streams ``torch.save`` output into a temp file *in the target's directory* (so ``$TMPDIR`` on another
filesystem, or full, does not matter), hashing it on the way, appends the manifest, flushes and fsyncs it,
checks that it reads back, renames it over the target with ``os.replace`` and fsyncs the directory. Temp
files that a killed process left behind are removed the next time this IO writes into that directory.

The manifest (sha256 and size of the ``torch.save`` payload, global step, epoch, world size, library
versions) is stored as the zip archive comment of the checkpoint itself: one file, one atomic rename, so a
crash can never pair a new checkpoint with an old manifest. ``torch.load`` and ``zipfile`` ignore the
comment, so the file stays an ordinary checkpoint for every other tool.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import platform
import re
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_solo.comm import shard_dir
from lightning_solo.decision import Decision

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "lightning_solo.checkpoint"
MANIFEST_VERSION = 1
_EOCD = b"PK\x05\x06"  # zip "end of central directory" record: 22 bytes, the last 2 = comment length
_EOCD_SIZE = 22
_MAX_COMMENT = 0xFFFF
_TMP_MARK = ".solo-tmp-"
_TMP_RE = re.compile(r"^\.(?P<base>.+)\.(?P<pid>\d+)@(?P<host>.+)\.solo-tmp-[^/]*$")
_CHUNK = 1 << 22


class CheckpointVerificationError(ValueError):
    """A checkpoint file is truncated, corrupted, or carries no manifest; ``path`` names it."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"checkpoint {self.path!r} failed verification: {reason}")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """``weights_only=True`` refused a checkpoint that contains pickled Python objects."""


class SoloCheckpointIO(TorchCheckpointIO):
    """Atomic, fsynced, self-verifying checkpoint files (local paths; remote URLs go to Lightning's IO).

    Args:
        weights_only: default for loads. ``True`` refuses checkpoints holding arbitrary pickled objects
            (they can run code when loaded); pass ``weights_only=False`` to a load, or here, to opt in for
            files you trust.
        verify_after_write: re-read and re-hash the temp file before it replaces the target. Off by default:
            the sha256 is taken from the very bytes handed to the file, and every write gets a cheap
            structural check (size and manifest read back from the file's end) before the rename; the
            re-read mostly hits the page cache, so it proves little for its cost (about +50% save time,
            see benchmarks/RESULTS.md). Loads and auto-resume always verify in full.
        require_manifest: refuse to load files without a manifest (e.g. written by stock Lightning). By
            default they load with a warning, since there is nothing to verify them against.
        fsync: flush file and directory to stable storage (turn off only for throwaway runs on slow disks).
        stale_after_s: temp files from another host are treated as abandoned after this many seconds (on
            this host a temp file is abandoned as soon as the process that wrote it is gone).
    """

    def __init__(
        self,
        weights_only: bool = True,
        verify_after_write: bool = False,
        require_manifest: bool = False,
        fsync: bool = True,
        stale_after_s: float = 3600.0,
    ) -> None:
        super().__init__()
        for name, value in (("weights_only", weights_only), ("verify_after_write", verify_after_write),
                            ("require_manifest", require_manifest), ("fsync", fsync)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        self.weights_only = weights_only
        self.verify_after_write = verify_after_write
        self.require_manifest = require_manifest
        self.fsync = fsync
        self.stale_after_s = float(stale_after_s)
        self._cleaned_dirs: set[str] = set()
        self.removed_temp_files: list[str] = []

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically. ``storage_options`` may be a dict of extra manifest
        fields, e.g. ``{"trigger": "exception"}``."""
        if not _is_local_file_protocol(path):
            rank_zero_warn(f"{path!r} is not a local path; falling back to Lightning's (non-atomic) writer")
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict of manifest fields or None, got {storage_options!r}")
        path = os.path.abspath(os.fspath(path))
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        if directory not in self._cleaned_dirs:
            self.removed_temp_files += clean_stale_temp_files(directory, self.stale_after_s)
            self._cleaned_dirs.add(directory)
        extra = {"trigger": "train", **(storage_options or {})}
        _atomic_write(path, lambda f: torch.save(checkpoint, f), _manifest_fields(checkpoint, extra),
                      fsync=self.fsync, verify_after_write=self.verify_after_write)

    @override
    def load_checkpoint(
        self,
        path,
        map_location: Callable | Any = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Verify ``path`` against its manifest, then ``torch.load`` it (``weights_only`` defaults to the
        IO's setting, ``True``)."""
        weights_only = self.weights_only if weights_only is None else weights_only
        if not _is_local_file_protocol(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if not self.require_manifest and (legacy := _unverifiable(path)):
            rank_zero_warn(f"{os.fspath(path)!r} {legacy}; loading it unverified")
        else:
            verify(path)
        return load_weights_only(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path) -> None:
        if not _is_local_file_protocol(path):
            return super().remove_checkpoint(path)
        shutil.rmtree(shard_dir(path), ignore_errors=True)  # its PowerSGD shards, if any
        try:
            os.remove(path)
        except FileNotFoundError:
            return
        _fsync_dir(os.path.dirname(os.path.abspath(path)))


def load_weights_only(path, map_location: Any = None, weights_only: bool = True) -> Any:
    """``torch.load`` that explains a ``weights_only`` refusal and how to opt out."""
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if not weights_only:
            raise
        raise UnsafeCheckpointError(
            f"{os.fspath(path)!r} contains pickled Python objects that weights_only=True refuses to load, because"
            " unpickling them can run arbitrary code. If you trust this file, load it with weights_only=False"
            " (trainer.fit(..., weights_only=False), SoloCheckpointIO(weights_only=False), or"
            f" torch.load(..., weights_only=False)). torch said: {err}"
        ) from err


# ---------------------------------------------------------------------------------------------------------
# writing


class _HashingWriter:
    """File-like that hashes what ``torch.save`` streams through it (torch only calls write/flush)."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()


def _atomic_write(path: str, dump: Callable[[Any], None], manifest: dict[str, Any], *, fsync: bool = True,
                  verify_after_write: bool = True) -> None:
    directory, base = os.path.split(path)
    prefix = f".{base}.{os.getpid()}@{socket.gethostname()}{_TMP_MARK}"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a checkpoint gets the mode open() would give
        with os.fdopen(fd, "w+b") as raw:
            writer = _HashingWriter(raw)
            dump(writer)
            manifest = {**manifest, "sha256": writer.sha.hexdigest(), "size": writer.size}
            manifest = _append_manifest(raw, writer.size, manifest)
            raw.flush()
            if fsync:
                os.fsync(raw.fileno())
        if verify_after_write:
            verify(tmp)
        elif read_manifest(tmp) != manifest or os.path.getsize(tmp) != _file_size(manifest):
            raise CheckpointVerificationError(tmp, "the written file does not read back as written")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        _fsync_dir(directory)


def _umask() -> int:
    # os.umask can only be read by setting it; /proc has it without that race (Linux >= 4.7).
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _comment_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def _file_size(manifest: dict[str, Any]) -> int:
    return manifest["size"] + len(_comment_bytes(manifest))


def _append_manifest(raw, payload_size: int, manifest: dict[str, Any]) -> dict[str, Any]:
    manifest = {**manifest, "manifest_sha256": _manifest_digest(manifest)}
    comment = _comment_bytes(manifest)
    if len(comment) > _MAX_COMMENT:
        raise ValueError(f"manifest is {len(comment)} bytes; a zip comment holds at most {_MAX_COMMENT}")
    raw.flush()
    raw.seek(payload_size - _EOCD_SIZE)
    eocd = raw.read(_EOCD_SIZE)
    if eocd[:4] != _EOCD or eocd[-2:] != b"\x00\x00":
        raise RuntimeError("torch.save did not end with a plain zip end-of-central-directory record")
    raw.seek(payload_size - 2)
    raw.write(struct.pack("<H", len(comment)) + comment)
    return manifest


def _manifest_digest(manifest: dict[str, Any]) -> str:
    # The payload hash does not cover the manifest's own fields (step, epoch, ...); this does.
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(_comment_bytes(body)).hexdigest()


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable; not possible on every platform/filesystem, hence best effort.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _manifest_fields(checkpoint: Any, extra: dict[str, Any]) -> dict[str, Any]:
    import lightning

    from lightning_solo import __version__

    ckpt = checkpoint if isinstance(checkpoint, dict) else {}
    dist = torch.distributed
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "global_step": _as_int(ckpt.get("global_step")),
        "epoch": _as_int(ckpt.get("epoch")),
        "world_size": world_size,
        "created": time.time(),
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__,
                     "lightning_solo": __version__, "python": platform.python_version()},
        **extra,
    }


def _as_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def clean_stale_temp_files(directory: str | os.PathLike, stale_after_s: float = 3600.0) -> list[str]:
    """Remove temp files that a crashed writer left in ``directory``; returns their paths.

    A temp file from this host is stale once the process that wrote it is gone; one from another host
    (shared filesystem) once it is older than ``stale_after_s``. Live writers' files are left alone.
    """
    removed = []
    host = socket.gethostname()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        match = _TMP_RE.match(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        if match["host"] == host:
            stale = not _pid_alive(int(match["pid"]))
        else:
            try:
                stale = time.time() - os.path.getmtime(path) > stale_after_s
            except FileNotFoundError:
                continue
        if stale:
            try:
                os.remove(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    if removed:
        log.info("removed %d stale checkpoint temp file(s) in %s", len(removed), directory)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed writer nobody reaped yet (containers often lack an init that reaps) is a zombie
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# ---------------------------------------------------------------------------------------------------------
# reading and verifying


def _tail(path) -> tuple[int, bytes]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        start = max(0, size - _EOCD_SIZE - _MAX_COMMENT)
        f.seek(start)
        return size, f.read()


def _locate_comment(size: int, tail: bytes) -> tuple[int, bytes] | None:
    """Offset of the end-of-central-directory record and the comment, if the file ends in one."""
    base = size - len(tail)
    pos = tail.rfind(_EOCD)
    while pos >= 0:
        if pos + _EOCD_SIZE <= len(tail):
            (comment_len,) = struct.unpack("<H", tail[pos + 20:pos + 22])
            if pos + _EOCD_SIZE + comment_len == len(tail):
                return base + pos, tail[pos + _EOCD_SIZE:]
        pos = tail.rfind(_EOCD, 0, pos)
    return None


def read_manifest(path: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest stored in ``path``, or ``None`` when the file has none (or no intact zip ending).
    Cheap: reads only the file's tail, verifies nothing."""
    try:
        size, tail = _tail(path)
    except OSError:
        return None
    located = _locate_comment(size, tail)
    if located is None or not located[1]:
        return None
    try:
        manifest = json.loads(located[1])
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT else None


# torch.save(..., _use_new_zipfile_serialization=False) starts with pickle protocol 2 and torch's magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _unverifiable(path) -> str | None:
    """Why ``path`` is a complete checkpoint with nothing to verify it against (a zip without a comment, e.g.
    stock Lightning's, or torch's pre-zip format), or ``None`` when it must verify."""
    located = _locate_comment(*_tail(path))
    if located is not None:
        return "has no lightning_solo manifest" if located[1] == b"" else None
    with open(path, "rb") as f:
        return "is in torch's legacy (non-zip) format, with no manifest" if f.read(14) == _LEGACY_MAGIC else None


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Check ``path`` against its manifest (size and sha256 of everything but the manifest) and return
    the manifest; raise :class:`CheckpointVerificationError` naming the file otherwise."""
    try:
        size, tail = _tail(path)
    except FileNotFoundError:
        raise CheckpointVerificationError(path, "the file does not exist") from None
    located = _locate_comment(size, tail)
    if located is None:
        raise CheckpointVerificationError(path, "the file does not end in a zip directory (truncated?)")
    eocd_offset, comment = located
    if not comment:
        raise CheckpointVerificationError(path, "the file carries no lightning_solo manifest")
    try:
        manifest = json.loads(comment)
    except ValueError:
        raise CheckpointVerificationError(path, "the manifest is not valid JSON (corrupted)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointVerificationError(path, "the zip comment is not a lightning_solo manifest")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointVerificationError(path, "the manifest's own checksum does not match (corrupted)")
    payload_size = eocd_offset + _EOCD_SIZE
    if manifest.get("size") != payload_size:
        raise CheckpointVerificationError(
            path, f"payload is {payload_size} bytes, the manifest says {manifest.get('size')} (truncated?)")
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = payload_size - 2  # the comment-length field was 0 when the payload was hashed
        while remaining:
            chunk = f.read(min(_CHUNK, remaining))
            if not chunk:
                raise CheckpointVerificationError(path, "the file shrank while it was read")
            sha.update(chunk)
            remaining -= len(chunk)
    sha.update(b"\x00\x00")
    if sha.hexdigest() != manifest.get("sha256"):
        raise CheckpointVerificationError(path, "sha256 mismatch: the contents are corrupted")
    return manifest


# ---------------------------------------------------------------------------------------------------------
# choosing a checkpoint to resume from


def _candidates(dirpath: str | os.PathLike) -> list[Path]:
    directory = Path(dirpath)
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.suffix == ".ckpt" and p.is_file() and _TMP_MARK not in p.name]


def decide_resume(dirpath: str | os.PathLike | None, include_exception: bool = False) -> Decision:
    """The newest checkpoint in ``dirpath`` that verifies (by global step, then write time), and why the
    newer ones were passed over. Checkpoints written while handling an exception (they may hold a
    half-finished step) are only considered with ``include_exception=True``."""
    if dirpath is None:
        return Decision("resume", None, "no checkpoint directory is configured; starting fresh")
    skipped: list[str] = []
    ranked = []
    for path in _candidates(dirpath):
        manifest = read_manifest(path)
        if manifest is None:
            try:
                verify(path)  # fails; it says why
            except CheckpointVerificationError as err:
                skipped.append(f"{path.name}: {err.reason}")
        elif manifest.get("trigger") == "exception" and not include_exception:
            skipped.append(f"{path.name}: written during an exception")
        else:
            step = manifest.get("global_step")
            ranked.append(((step if isinstance(step, int) else -1, manifest.get("created", 0.0)), path))
    for _, path in sorted(ranked, key=lambda item: item[0], reverse=True):
        try:
            manifest = verify(path)
        except CheckpointVerificationError as err:
            skipped.append(f"{path.name}: {err.reason}")
            continue
        reason = f"newest checkpoint that verifies (global step {manifest.get('global_step')})"
        if skipped:
            reason += "; passed over " + "; ".join(skipped)
        return Decision("resume", str(path), reason)
    reason = f"no checkpoint in {os.fspath(dirpath)!r} verifies; starting fresh"
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


def resolve_ckpt_path(ckpt_path: str | os.PathLike | None, dirpath: str | os.PathLike | None) -> str | None:
    """Map the runner's ``resume`` value to ``Trainer.fit(ckpt_path=...)``: ``None`` stays ``None``,
    ``"auto"`` becomes the newest checkpoint in ``dirpath`` that verifies (or ``None``, logged either way),
    anything else is passed through (Lightning's ``"last"``/``"best"`` included)."""
    if ckpt_path is None or os.fspath(ckpt_path) != "auto":
        return None if ckpt_path is None else os.fspath(ckpt_path)
    decision = decide_resume(dirpath)
    rank_zero_info(f"resume=auto: {decision}")
    return decision.value
