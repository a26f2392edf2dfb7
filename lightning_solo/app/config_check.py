"""Check a composed config against the signatures of the classes it will build, before anything runs: keys added
with ``+``, values of the wrong type, options a ``_target_`` does not accept (docs/runner.md)."""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_solo.core.checks import is_int, is_number


class ConfigError(ValueError):
    """A config key or value that the run cannot use."""


def check_config(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` naming the first bad key; return quietly otherwise."""
    container: dict[str, Any] = {}
    for key in cfg:
        if key == "hydra":
            continue
        try:
            node = cfg[key]
            container[str(key)] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        except OmegaConfBaseException as err:
            where = getattr(err, "full_key", None) or str(key)
            raise ConfigError(f"{where}: {str(err).splitlines()[0]}") from err
    _check_parallelism(container.get("parallelism") or {})  # first: its keys feed the strategy's
    for path, node in _target_nodes(container):
        _check_node(path, node)


def _target_nodes(node: Any, path: str = "") -> Iterator[tuple[str, dict]]:
    if isinstance(node, dict):
        if "_target_" in node:
            yield path, node
        for key, value in node.items():
            yield from _target_nodes(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _target_nodes(value, f"{path}[{i}]")


def _signature(target: str, path: str) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    try:
        obj = get_object(target)
    except Exception as err:  # ImportError, AttributeError, ... all mean "cannot find it"
        raise ConfigError(f"{path}._target_: cannot import {target!r} ({err})") from err
    return _parameters(obj)


def _parameters(obj: Any) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    """``obj``'s parameters and type hints, with those of where its ``**kwargs`` go (:func:`_kwargs_targets`)."""
    fn = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = dict(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return {}, {}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: skip type checks, keep key checks
        hints = {}
    forwarded = [n for n, p in params.items() if p.kind is p.VAR_KEYWORD]
    targets = _kwargs_targets(obj) if forwarded else []
    if targets:
        del params[forwarded[0]]
    for target in targets:
        target_params, target_hints = _parameters(target)
        params.update({n: p for n, p in target_params.items() if n not in params and n != "module"})
        hints = {**target_hints, **hints}
    return params, hints


def _kwargs_targets(obj: Any) -> list[Any]:
    """Where ``obj`` passes its ``**kwargs``: a ``DDPStrategy`` subclass to it, ``DDPStrategy`` to
    ``DistributedDataParallel``, a class of this package to its base (the datamodules' loader options)."""
    if not inspect.isclass(obj):
        return []
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    if obj is DDPStrategy:
        return [DistributedDataParallel]
    if issubclass(obj, DDPStrategy):
        return [DDPStrategy]
    base = obj.__mro__[1] if len(obj.__mro__) > 1 else None
    return [base] if base is not None and base.__module__.startswith("lightning_solo.") else []


def _check_node(path: str, node: dict) -> None:
    params, hints = _signature(node["_target_"], path)
    if not params:
        return
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for key, value in node.items():
        full = f"{path}.{key}" if path else key
        if (key.startswith("_") and key.endswith("_")) or (key not in params and takes_kwargs):
            continue
        if key not in params:
            raise ConfigError(f"{full}: {node['_target_']} has no option '{key}'.{_accepted(key, names)}")
        _check_type(full, value, hints.get(key))


def _check_parallelism(par: dict) -> None:
    allowed = ["accelerator", "devices", "num_nodes", "precision", "strategy"]
    _, hints = _signature("lightning.pytorch.Trainer", "parallelism")
    for key, value in par.items():
        if key not in allowed:
            raise ConfigError(f"parallelism.{key}: unknown option.{_accepted(key, allowed)}")
        # precision "auto" is SoloDDP's own rule (bf16 / fp16 / fp32 by device), unknown to the Trainer
        if key != "strategy" and not (key == "precision" and value == "auto"):
            _check_type(f"parallelism.{key}", value, hints.get(key))


def _accepted(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1)
    return (f" Did you mean '{close[0]}'?" if close else "") + f" Accepted: {', '.join(names)}"


def _check_type(full: str, value: Any, hint: Any) -> None:
    if hint is not None and not _matches(value, hint):
        raise ConfigError(f"{full}: expected {_describe(hint)}, got {value!r} ({type(value).__name__})")


def _matches(value: Any, hint: Any) -> bool:
    """A conservative isinstance for annotations: False only when the value clearly cannot fit."""
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    if isinstance(value, dict) and "_target_" in value:
        return True  # built by Hydra; its own node is checked separately
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, (bool, int, float, str)):  # a plain value must fit a plain member, not a class
            plain = [a for a in args if _is_plain_type(a) or typing.get_origin(a) is typing.Literal or a is type(None)]
            if plain:
                return any(_matches(value, a) for a in plain)
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if value is None:
        return False
    if hint is int:
        return is_int(value)
    if hint is float:
        return is_number(value)
    base = origin or hint
    if base in (list, tuple, set, Sequence, typing.Sequence):
        return isinstance(value, (list, tuple))
    if base in (dict, Mapping, typing.Mapping):
        return isinstance(value, dict)
    if inspect.isclass(base) and isinstance(value, (bool, int, float, str, list, dict)):  # bool, str or a class
        return isinstance(value, base) or base in (Callable,) or not _is_plain_type(base)
    return True


def _is_plain_type(cls: type) -> bool:
    return cls in (bool, int, float, str, list, dict, tuple)


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
