"""On CPU, keep the memory of freed tensors for the next step instead of faulting fresh pages in every step.

Tensors on CPU come from glibc's ``malloc``. It hands freed blocks back to the kernel: blocks above its
(adaptive) mmap threshold at once, and the heap's free top once it exceeds the trim threshold. A training step
frees and re-allocates the same tensor sizes every step, so every step then first-touches fresh zeroed pages,
about 2 µs per 4 KiB page. Measured on this project's CPU benchmarks (``benchmarks/RESULTS.md``): SoloDDP on
ResNet-18 took ~34,000 page faults per batch (gradient bucket views shift the allocation pattern), stock
Lightning ~7,400, and ~350 with this setting; a DDP-wrapped wide MLP outside DDP's reducer faulted all its
~12,300 gradient pages every step, the same model unwrapped none.

:func:`decide` sets the mmap threshold to glibc's ceiling (32 MiB on 64-bit) and the trim threshold
to 1 GiB: blocks up to 32 MiB stay in the heap and are reused. It is process-wide and lasts for the process
(glibc cannot go back to its adaptive threshold); processes forked later (loader workers) inherit it. It leaves
the allocator alone where the user chose one: another allocator preloaded (jemalloc or tcmalloc, as
``python -m torch.backends.xeon.run_cpu`` advises for CPU training), or glibc's own knobs set in the
environment.

Example::

    print(decide(reuse=True))  # SoloDDP does this on CPU; SoloDDP(cpu_malloc_reuse=False) does not
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from typing import Any

from lightning_solo.decision import Decision

SETTING = "cpu_malloc"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2**30
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")
_GLIBC_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def glibc() -> Any:
    """This process's glibc (``mallopt``, ``malloc_trim``), or ``None`` where malloc is not glibc's."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL(None)  # the C library this process runs on
        if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
            return libc
    return None


def decide(reuse: bool) -> Decision:
    """``reuse``: keep freed blocks up to 32 MiB in glibc's heap for reuse (see the module docstring). Returns
    the record of what was done, or why the allocator was left alone."""
    if not reuse:
        return Decision(SETTING, "unchanged", "cpu_malloc_reuse=False")
    if preloaded := [name for name in _PRELOADED if name in os.environ.get("LD_PRELOAD", "")]:
        return Decision(SETTING, "unchanged", f"{preloaded[0]} is preloaded: the user's allocator")
    knobs = [k for k in _GLIBC_KNOBS if k in os.environ]
    if knobs or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return Decision(
            SETTING, "unchanged", f"glibc's malloc set by the user ({', '.join(knobs) or 'GLIBC_TUNABLES'})"
        )
    if (libc := glibc()) is None:
        return Decision(SETTING, "unchanged", "not glibc's malloc: left alone")
    if not (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ):
        return Decision(SETTING, "unchanged", "glibc refused mallopt: left as it was")
    return Decision(
        SETTING,
        "reuse freed memory",
        "glibc mmap threshold 32 MiB, trim threshold 1 GiB: freed tensors up to 32 MiB are reused instead of "
        "faulted in fresh every step (SoloDDP(cpu_malloc_reuse=False) to leave malloc alone)",
    )
