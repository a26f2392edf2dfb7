"""The checkpoint manifest (sha256 and size of the ``torch.save`` payload, step, epoch, world size, versions), stored
as the zip comment of the checkpoint itself, and the checks that verify a file against it. See docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import struct
import time
from typing import Any

import lightning
import torch

from lightning_solo._version import __version__
from lightning_solo.core.ranks import world_size

MANIFEST_FORMAT = "lightning_solo.checkpoint"
MANIFEST_VERSION = 1
_EOCD = b"PK\x05\x06"  # zip "end of central directory" record: 22 bytes, the last 2 = comment length
_EOCD_SIZE = 22
_MAX_COMMENT = 0xFFFF
_CHUNK = 1 << 22


class CheckpointVerificationError(ValueError):
    """A checkpoint file is truncated, corrupted, or carries no manifest; ``path`` names it."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"checkpoint {self.path!r} failed verification: {reason}")


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


def _manifest_digest(manifest: dict[str, Any]) -> str:  # covers the manifest's own fields (step, epoch, ...)
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(_comment_bytes(body)).hexdigest()


def _manifest_fields(checkpoint: Any, extra: dict[str, Any]) -> dict[str, Any]:
    ckpt = checkpoint if isinstance(checkpoint, dict) else {}
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "global_step": _as_int(ckpt.get("global_step")),
        "epoch": _as_int(ckpt.get("epoch")),
        "world_size": world_size(),
        "created": time.time(),
        "versions": {
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "lightning_solo": __version__,
            "python": platform.python_version(),
        },
        **extra,
    }


def _as_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


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
            (comment_len,) = struct.unpack("<H", tail[pos + 20 : pos + 22])
            if pos + _EOCD_SIZE + comment_len == len(tail):
                return base + pos, tail[pos + _EOCD_SIZE :]
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
            path, f"payload is {payload_size} bytes, the manifest says {manifest.get('size')} (truncated?)"
        )
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
