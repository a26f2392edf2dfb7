"""What may cross from a worker process back to the notebook parent: plain CPU data. See docs/notebooks.md."""

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


class NotPlain(TypeError):
    """A value that may not cross to the parent: not data, or a tensor that is not a plain CPU tensor."""


#: What :func:`unpack` returns for a value that did not come back.
LEFT_BEHIND = object()

_ATOMS = (type(None), bool, int, float, complex, str, bytes, Enum, PurePath, range, slice, torch.dtype, torch.device)


def pack(value: Any, what: str) -> bytes | None:
    """``value`` as plain CPU data (:func:`plain`), pickled; ``None`` (logged) when it is not data or does not
    pickle (a class defined inside a function, say)."""
    try:
        return pickle.dumps(plain(value))
    except Exception as err:  # noqa: BLE001 - anything that is not plain data stays behind
        log.debug("not sent back to the parent: %s (%s)", what, err)
        return None


def unpack(blob: bytes | None, what: str) -> Any:
    """The value :func:`pack` made, or :data:`LEFT_BEHIND` (warned about) when it cannot be unpickled here."""
    if blob is None:
        return LEFT_BEHIND
    try:
        return pickle.loads(blob)  # our own worker's bytes, plain CPU data only (pack)
    except Exception as err:  # noqa: BLE001 - one value lost, not the whole result
        rank_zero_warn(f"could not bring {what} back from the worker process: {err!r}")
        return LEFT_BEHIND


def is_plain_tensor(value: torch.Tensor) -> bool:
    """A plain ``torch.Tensor`` (no subclass) whose data is on the CPU."""
    return type(value) is torch.Tensor and value.device.type == "cpu" and not value.is_cuda


def plain(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` made of plain data, every tensor a plain CPU tensor; raises :class:`NotPlain`."""
    if depth > 32:
        raise NotPlain("nested too deeply")
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, torch.Tensor):
        return _cpu_tensor(value)
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None and value.dtype != object:
        return value.copy()
    if isinstance(value, dict):
        mapping = copy.copy(value)  # keeps the subclass (OrderedDict, a defaultdict's factory, AttributeDict)
        mapping.clear()
        for key, item in value.items():
            mapping[plain(key, depth + 1)] = plain(item, depth + 1)
        return mapping
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [plain(item, depth + 1) for item in value]
        if isinstance(value, list):
            sequence = copy.copy(value)
            sequence[:] = items
            return sequence
        if hasattr(value, "_fields"):  # a namedtuple
            return value._make(items)  # type: ignore[union-attr]
        return type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        instance: Any = copy.copy(value)
        for field in dataclasses.fields(value):
            object.__setattr__(instance, field.name, plain(getattr(value, field.name), depth + 1))  # frozen too
        return instance
    raise NotPlain(type(value).__name__)


def _cpu_tensor(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.nn.Parameter):
        raise NotPlain("a parameter belongs to a module")
    try:
        copied = value.detach().to("cpu", copy=True)
        if type(copied) is not torch.Tensor:
            # A subclass may report a device it does not hold, or wrap one: keep the data, drop the class.
            copied = copied.as_subclass(torch.Tensor).clone()
    except Exception as err:  # a meta tensor has no data to copy
        raise NotPlain(f"a {type(value).__name__} on {value.device} has no data the CPU can copy: {err}") from err
    if not is_plain_tensor(copied):
        raise NotPlain(f"a {type(value).__name__} on {value.device} did not become a plain CPU tensor")
    return copied
