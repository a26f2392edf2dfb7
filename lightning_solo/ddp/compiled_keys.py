"""Compiled submodules' checkpoint keys: ``torch.compile(Net())`` holds the net as ``_orig_mod``
(``net._orig_mod.weight`` where the eager module has ``net.weight``); a checkpoint loads with either spelling.
See docs/compile.md."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from lightning_solo._compat import torch as torch_compat
from lightning_solo.core.checks import check_bool
from lightning_solo.core.decision import Decision

_CHILD = torch_compat.COMPILED_CHILD


class CompiledKeys:
    """SoloDDP's ``strip_compiled_prefix=``: save the eager module's keys."""

    def __init__(self, strip: bool = False) -> None:
        self.strip = check_bool("strip_compiled_prefix", strip)

    def decision(self, module: torch.nn.Module | None) -> Decision | None:
        """What applies to ``module`` (``None``: before there is one). ``None`` at the default when ``module``
        holds no compiled submodule (nothing differs from stock); stripping is always the user's setting."""
        compiled = [] if module is None else [
            name for name, m in module.named_modules() if name and torch_compat.is_compiled_module(m)
        ]  # fmt: skip
        which = f"compiled submodules {compiled}" if compiled else "compiled submodules"
        if self.strip:
            return Decision(
                "strip_compiled_prefix",
                True,
                f"set by the user: {which} save the eager module's keys (no '{_CHILD}.'); Model.load_from_checkpoint "
                "of a class that compiles them needs torch's keys",
            )
        if not compiled:
            return None
        return Decision(
            "strip_compiled_prefix",
            False,
            f"{which} save torch's keys ('{_CHILD}.'), as stock, which Model.load_from_checkpoint of this class "
            "needs; through the Trainer a checkpoint loads with either spelling, so it moves between compiled and "
            "eager runs (strip_compiled_prefix=True: save the eager module's keys)",
        )

    def save(self, state_dict: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
        """``state_dict`` (of ``module``); stripping: with the ``_orig_mod`` level of each compiled submodule
        removed."""
        inner = _compiled_children(module)
        if not self.strip or not inner:
            return state_dict
        return _renamed(state_dict, lambda key: _without(key, inner))

    def load(self, state_dict: Mapping[str, Any], module: torch.nn.Module) -> Mapping[str, Any]:
        """``state_dict`` with each key ``module`` spells differently, compiled or not, in ``module``'s spelling."""
        inner = _compiled_children(module)
        # Keys, and module paths for the version metadata; the inner module's path comes after its wrapper's.
        names = [*module.state_dict(), *(name for name, _ in module.named_modules())]
        own = {_without(name, inner): name for name in names}
        if all(key in own.values() for key in state_dict):
            return state_dict  # already this module's spelling (or keys strict loading will name)

        def spelled(key: str) -> str:
            plain = eager_key(key)  # whatever compiled it
            return own.get(plain, key) if plain != key or key not in own.values() else key

        return _renamed(state_dict, spelled)


def eager_key(key: str) -> str:
    """``key`` without any compiled module's ``_orig_mod`` level: ``net._orig_mod.weight`` -> ``net.weight``."""
    return ".".join(part for part in key.split(".") if part != _CHILD)


def _compiled_children(module: torch.nn.Module) -> set[str]:
    """The paths of the ``_orig_mod`` children of the compiled submodules: ``{"net._orig_mod"}``."""
    return {
        f"{name}.{_CHILD}" if name else _CHILD
        for name, m in module.named_modules()
        if torch_compat.is_compiled_module(m)
    }


def _without(key: str, inner: set[str]) -> str:
    """``key`` without the path components that are a compiled submodule's ``_orig_mod``."""
    parts, path = [], ""
    for part in key.split("."):
        path = f"{path}.{part}" if path else part
        if path not in inner:
            parts.append(part)
    return ".".join(parts)


def _renamed(state_dict: Mapping[str, Any], rename: Any) -> dict[str, Any]:
    """A new state dict with keys (and the version metadata's module paths) renamed; the tensors are the same."""
    out: OrderedDict[str, Any] = OrderedDict((rename(key), value) for key, value in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # module versions (BatchNorm's, say), keyed by module path
        # The inner module's entry comes after its wrapper's and wins: its version is the one that loads eagerly.
        out._metadata = OrderedDict((rename(path), meta) for path, meta in metadata.items())  # type: ignore[attr-defined]
    return out
