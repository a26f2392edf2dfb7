"""A fork that does not inherit OpenMP's thread pool: without this, a forked rank can hang at its first parallel op.
See docs/cpu-training.md."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

_PAUSE_HARD = 2  # omp_pause_hard: the runtime frees its threads and state


def _runtime() -> ctypes.CDLL | None:
    """torch's OpenMP runtime as loaded in this process (``None``: another parallel backend, or none found)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    shipped = sorted(Path(torch.__file__).parent.joinpath("lib").glob("lib*omp*.so*"))
    try:
        return ctypes.CDLL(str(shipped[0])) if shipped else ctypes.CDLL(None)
    except OSError:
        return None


def release_thread_pool() -> bool:
    """End OpenMP's idle threads in this process, so that a ``fork`` now gives children a usable runtime.
    Returns whether the runtime did (False: not OpenMP, or a runtime without OpenMP 5.0's pause)."""
    runtime = _runtime()
    pause = getattr(runtime, "omp_pause_resource_all", None)
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(_PAUSE_HARD) == 0
