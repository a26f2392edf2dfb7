"""What glibc's malloc does now in this process, observed through ``mallinfo2`` rather than read back (glibc has
no call that reports its thresholds): whether a block of a given size is mapped on its own, whether a freed heap
top goes back to the kernel, and whether the mmap threshold still adapts by itself (no ``mallopt`` call yet)."""

from __future__ import annotations

import ctypes

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
           "keepcost")  # fmt: skip


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


_libc = ctypes.CDLL(None)
_libc.malloc.restype, _libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
_libc.free.restype, _libc.free.argtypes = None, [ctypes.c_void_p]
_libc.mallinfo2.restype = _Mallinfo2


def info() -> dict[str, int]:
    got = _libc.mallinfo2()
    return {name: getattr(got, name) for name in _FIELDS}


def mapped(size: int, limit: int = 2**31) -> bool:
    """Whether glibc now maps a block of ``size`` bytes on its own (``size`` is at or above the mmap threshold).
    The threshold only decides when the heap must grow (a free chunk or the heap's top serves a request first), so
    blocks are taken until one is mapped or the heap grows; then all are freed."""
    start, blocks = info(), []
    try:
        while len(blocks) * size < limit:
            blocks.append(_libc.malloc(size))
            now = info()
            if now["hblkhd"] - start["hblkhd"] >= size:
                return True
            if now["arena"] > start["arena"]:
                return False
        raise AssertionError(f"{limit} bytes of {size}-byte blocks neither grew the heap nor were mapped")
    finally:
        for b in reversed(blocks):
            _libc.free(b)


def trims(block: int = 100 * 1024, grow: int = 8 * 2**20) -> bool:
    """Whether a heap top of ``grow`` bytes, freed, goes back to the kernel (the trim threshold is below it).
    Blocks of ``block`` bytes (under glibc's starting mmap threshold) are allocated until the heap has grown by
    ``grow`` past the free chunks it already had, then freed newest first, so that they merge into the top."""
    start, blocks = info()["arena"], []
    try:
        while info()["arena"] - start < grow and len(blocks) < 4 * grow // block:
            blocks.append(_libc.malloc(block))
        grown = info()["arena"]
    finally:
        for b in reversed(blocks):
            _libc.free(b)
    return grown - info()["arena"] >= grow // 2


def adaptive() -> bool | None:
    """Whether glibc still raises its mmap threshold by itself (no ``mallopt`` has fixed it): a block that was
    mapped, once freed, comes from the heap the next time. ``None`` when no size up to 24 MiB is mapped now."""
    for size in (256 * 1024, 2**20, 4 * 2**20, 24 * 2**20):
        if mapped(size):  # freeing it raises an adaptive threshold to its size
            return not mapped(size)
    return None
