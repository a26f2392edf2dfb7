"""On CPU, for the length of a fit, keep the memory of freed tensors for the next step instead of faulting fresh
pages in every step. See docs/cpu-training.md."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from typing import Any

from lightning_solo.core.decision import Decision

SETTING = "cpu_malloc"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2**30
# glibc's values when a process starts (DEFAULT_MMAP_THRESHOLD_MIN, DEFAULT_TRIM_THRESHOLD): what restore() sets.
START_MMAP_THRESHOLD = START_TRIM_THRESHOLD = 128 * 1024
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")
_GLIBC_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

# Whether decide() changed this process's malloc, not undone yet (per process, as mallopt; a fork inherits both).
_in_force = False


def glibc() -> Any:
    """This process's glibc (``mallopt``, ``malloc_trim``), or ``None`` where malloc is not glibc's."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL(None)  # the C library this process runs on
        if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
            return libc
    return None


def user_choice() -> str | None:
    """Why the user's allocator settings rule out touching glibc's malloc, or ``None``."""
    if preloaded := [name for name in _PRELOADED if name in os.environ.get("LD_PRELOAD", "")]:
        return f"{preloaded[0]} is preloaded: the user's allocator"
    knobs = [k for k in _GLIBC_KNOBS if k in os.environ]
    if knobs or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return f"glibc's malloc set by the user ({', '.join(knobs) or 'GLIBC_TUNABLES'})"
    return None


def in_force() -> bool:
    """Whether this process runs with :func:`decide`'s setting now."""
    return _in_force


def decide(reuse: bool) -> Decision:
    """``reuse``: keep freed blocks up to 32 MiB in glibc's heap until :func:`restore`; returns what was done."""
    global _in_force
    if not reuse:
        return Decision(SETTING, "unchanged", "cpu_malloc_reuse=False")
    if (why := user_choice()) is not None:
        return Decision(SETTING, "unchanged", why)
    if (libc := glibc()) is None:
        return Decision(SETTING, "unchanged", "not glibc's malloc: left alone")
    _in_force = True  # from the first call on, whatever glibc answers: restore() has something to undo
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        restore()
        return Decision(SETTING, "unchanged", "glibc refused mallopt: its starting values set back")
    return Decision(
        SETTING,
        "reuse freed memory",
        "glibc mmap threshold 32 MiB, trim threshold 1 GiB until the fit ends: freed tensors up to 32 MiB are "
        "reused instead of faulted in fresh every step (SoloDDP(cpu_malloc_reuse=False) to leave malloc alone)",
    )


def restore() -> bool:
    """Undo :func:`decide`: glibc's starting thresholds and ``malloc_trim(0)``; returns whether there was anything."""
    global _in_force
    if not _in_force:
        return False
    _in_force = False
    if (libc := glibc()) is not None:
        libc.mallopt(M_MMAP_THRESHOLD, START_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, START_TRIM_THRESHOLD)
        libc.malloc_trim(0)
    return True
