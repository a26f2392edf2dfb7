"""What crosses from a worker process back to the notebook parent: values that are plain data (containers,
numbers, strings, CPU copies of tensors, dataclasses), pickled; anything else (modules, optimizers, hooks, open
files, functions) stays behind, and the parent keeps its own."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
from enum import Enum
from pathlib import PurePath
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

log = logging.getLogger(__name__)


def packed_attributes(
    obj: object, only: tuple[str, ...] | None = None, public_only: bool = False, skip: tuple[str, ...] = ()
) -> dict[str, bytes]:
    """``obj``'s instance attributes that are data (see :func:`_plain`), each packed; the others are left out."""
    found: dict[str, bytes] = {}
    for name, value in vars(obj).items():
        if (only is not None and name not in only) or name in skip or (public_only and name.startswith("_")):
            continue
        if (packed := pack(value)) is None:
            log.debug("not sent back to the parent: %s.%s", type(obj).__name__, name)
            continue
        found[name] = packed
    return found


def unpack_attributes(packed: dict[str, bytes], owner: str) -> dict[str, Any]:
    """The values of :func:`packed_attributes`, less any that cannot be unpickled here (warned about)."""
    values = {name: unpack(blob, f"{owner}.{name}") for name, blob in packed.items()}
    return {name: value for name, value in values.items() if value is not LEFT_BEHIND}


LEFT_BEHIND = object()


def pack(value: Any) -> bytes | None:
    """A pickled CPU copy of ``value`` if it is plain data that pickles (a class defined inside a function
    does not), else ``None``."""
    try:
        return pickle.dumps(_plain(value))
    except Exception:
        return None


def unpack(blob: bytes | None, what: str) -> Any:
    """The value :func:`pack` made, or :data:`LEFT_BEHIND` (warned about) when it cannot be unpickled here."""
    if blob is None:
        return LEFT_BEHIND
    try:
        # Our own worker's bytes, of the kind Lightning's result queue already unpickles.
        return pickle.loads(blob)
    except Exception as err:
        rank_zero_warn(f"could not bring {what} back from the worker process: {err!r}")
        return LEFT_BEHIND


class _NotPlain(TypeError):
    pass


_ATOMS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    Enum,
    PurePath,
    range,
    slice,
    torch.dtype,
    torch.device,
)


def _plain(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` (tensors moved to the CPU) if it is made of data only; else :class:`_NotPlain`."""
    if depth > 32:
        raise _NotPlain("nested too deeply")
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, torch.Tensor):
        if isinstance(value, torch.nn.Parameter):
            raise _NotPlain("a parameter belongs to a module")
        return value.detach().to("cpu", copy=True)
    if (
        type(value).__module__ == "numpy"
        and getattr(value, "dtype", None) is not None
        and value.dtype != object
    ):
        return value.copy()
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the subclass (OrderedDict, a defaultdict's factory, AttributeDict)
        out.clear()
        for key, item in value.items():
            out[_plain(key, depth + 1)] = _plain(item, depth + 1)
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(item, depth + 1) for item in value]
        if isinstance(value, list):
            out = copy.copy(value)
            out[:] = items
            return out
        if hasattr(value, "_fields"):  # a namedtuple
            return type(value)._make(items)
        return type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = copy.copy(value)
        for field in dataclasses.fields(value):
            object.__setattr__(
                out, field.name, _plain(getattr(value, field.name), depth + 1)
            )  # frozen ones too
        return out
    raise _NotPlain(type(value).__name__)
