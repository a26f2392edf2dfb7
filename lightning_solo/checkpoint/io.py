"""SoloCheckpointIO: a checkpoint is the old complete file or the new one, never half of one, and proves it when
read back: temp file in the target's directory, sha256 and manifest, fsync, ``os.replace``. See docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.checkpoint import rank_shards
from lightning_solo.checkpoint.manifest import (
    CheckpointVerificationError,
    _append_manifest,
    _file_size,
    _manifest_fields,
    _unverifiable,
    read_manifest,
    verify,
)
from lightning_solo.core.checks import check_bool

log = logging.getLogger(__name__)

_TMP_MARK = ".solo-tmp-"
_TMP_RE = re.compile(r"^\.(?P<base>.+)\.(?P<pid>\d+)@(?P<host>.+)\.solo-tmp-[^/]*$")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """``weights_only=True`` refused a checkpoint that contains pickled Python objects."""


class SoloCheckpointIO(TorchCheckpointIO):
    """Atomic, fsynced, self-verifying checkpoint files (local paths; remote URLs go to Lightning's IO).

    Args:
        weights_only: default for loads: ``True`` refuses pickled Python objects (they can run code when loaded).
        verify_after_write: re-read and re-hash the temp file before the rename (about +50% save time).
        require_manifest: refuse to load files without a manifest (stock Lightning's), else loaded with a warning.
        fsync: flush file and directory to stable storage.
        stale_after_s: another host's temp files are abandoned after this long (this host's: with their process).
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
        self.weights_only = check_bool("weights_only", weights_only)
        self.verify_after_write = check_bool("verify_after_write", verify_after_write)
        self.require_manifest = check_bool("require_manifest", require_manifest)
        self.fsync = check_bool("fsync", fsync)
        self.stale_after_s = float(stale_after_s)
        self._cleaned_dirs: set[str] = set()
        self.removed_temp_files: list[str] = []
        self._stager: tuple[int, Any] | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically. ``storage_options`` may be a dict of extra manifest
        fields, e.g. ``{"trigger": "exception"}``."""
        if not lightning_compat.is_local_path(path):
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
        manifest = _manifest_fields(checkpoint, {"trigger": "train", **(storage_options or {})})
        if (writer := self.background()) is not None:
            return writer.stage(self, checkpoint, path, manifest)
        self.write_file(checkpoint, path, manifest)

    def write_file(self, checkpoint: Any, path: str, manifest: dict[str, Any]) -> None:
        """The write itself (in ``save_checkpoint``, or on the background thread for a staged save)."""
        directory, base = os.path.split(path)
        prefix = f".{base}.{os.getpid()}@{socket.gethostname()}{_TMP_MARK}"
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a checkpoint gets the mode open() would give
            with os.fdopen(fd, "w+b") as raw:
                writer: Any = _HashingWriter(raw)
                torch.save(checkpoint, writer)
                manifest = {**manifest, "sha256": writer.sha.hexdigest(), "size": writer.size}
                manifest = _append_manifest(raw, writer.size, manifest)
                raw.flush()
                if self.fsync:
                    os.fsync(raw.fileno())
            if self.verify_after_write:
                verify(tmp)
            elif read_manifest(tmp) != manifest or os.path.getsize(tmp) != _file_size(manifest):
                raise CheckpointVerificationError(tmp, "the written file does not read back as written")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync:
            _fsync_dir(directory)

    @contextlib.contextmanager
    def staging(self, writer: Any) -> Iterator[None]:
        """Within the block, this thread's saves are staged on ``writer``
        (:class:`~lightning_solo.checkpoint.background.BackgroundWriter`) instead of written."""
        previous, self._stager = getattr(self, "_stager", None), (threading.get_ident(), writer)
        try:
            yield
        finally:
            self._stager = previous

    def background(self) -> Any:
        """The writer staging this thread's saves (:meth:`staging`), or ``None``."""
        stager = getattr(self, "_stager", None)
        return stager[1] if stager is not None and stager[0] == threading.get_ident() else None

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
        if not lightning_compat.is_local_path(path):
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
        if not lightning_compat.is_local_path(path):
            return super().remove_checkpoint(path)
        rank_shards.remove(path)  # its per-rank shards (PowerSGD, post-local-SGD), if any
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
            f"{os.fspath(path)!r} holds pickled Python objects, which weights_only=True refuses (unpickling can run"
            f" code). A file you trust: weights_only=False (in fit, SoloCheckpointIO or torch.load). torch: {err}"
        ) from err


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


def _umask() -> int:  # /proc has it without os.umask's set-to-read race (Linux >= 4.7)
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _fsync_dir(directory: str) -> None:  # the rename itself durable, where the filesystem allows
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def clean_stale_temp_files(directory: str | os.PathLike, stale_after_s: float = 3600.0) -> list[str]:
    """Remove temp files that a crashed writer left in ``directory`` (this host's once their process is gone,
    another host's once older than ``stale_after_s``); returns their paths."""
    removed: list[str] = []
    host = socket.gethostname()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for match in filter(None, map(_TMP_RE.match, names)):
        path = os.path.join(directory, match.string)
        with contextlib.suppress(FileNotFoundError):  # another process removed it first
            mine = match["host"] == host
            if (not _pid_alive(int(match["pid"]))) if mine else time.time() - os.path.getmtime(path) > stale_after_s:
                os.remove(path)
                removed.append(path)
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
