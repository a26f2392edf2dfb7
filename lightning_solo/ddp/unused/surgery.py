"""Taking a DDP wrapper apart and building the next one, for ``find_unused_parameters="auto"``'s re-wraps."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import Module, Parameter
from torch.nn.parallel import DistributedDataParallel

from lightning_solo._compat import torch as torch_compat

SENTINEL = "_lightning_solo_usage_sentinel"


def trainable(module: Module) -> tuple[tuple[str, Parameter], ...]:
    """The ``(name, parameter)`` pairs that require grad: the parameters a DDP built now synchronises."""
    return tuple((n, p) for n, p in module.named_parameters() if p.requires_grad)


def reducer_parameters(ddp: DistributedDataParallel) -> list[Parameter]:
    """``ddp``'s parameters in its reducer's order (DDP's ``_build_params_for_reducer``), so indices map."""
    seen: set[int] = set()
    params = []
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or f"{module_name}.{param_name}" in ddp.parameters_to_ignore:
                continue
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def ddp_ignore_list(module: Module) -> list[str]:
    """The DDP ignore list the user set on ``module`` (kept to restore at the end of fit)."""
    return list(getattr(module, torch_compat.DDP_IGNORE_LIST, []))


def unwrap_excluding(
    ddp: DistributedDataParallel, excluded: list[str], user_ignore: list[str], keep_grads: bool = False
) -> Module:
    """Detach ``ddp`` from its module and mark ``excluded`` for the next wrapper to leave out; returns the module.
    Gradients (views of the old buckets) are reset, or copied out with ``keep_grads`` (manual optimization)."""
    module = ddp.module
    torch_compat.remove_autograd_hooks(ddp)
    for _, param in module.named_parameters():
        param.grad = param.grad.detach().clone() if keep_grads and param.grad is not None else None
    _clear_ignored_flags(module)
    # "." + name as well: DDP's reducer spells root-level parameters that way.
    torch_compat.set_params_to_ignore(module, user_ignore + excluded + ["." + n for n in excluded if "." not in n])
    return module


def restore_ignore_list(module: Module, user_ignore: list[str]) -> None:
    """Give ``module`` back the user's own DDP ignore list."""
    setattr(module, torch_compat.DDP_IGNORE_LIST, user_ignore)
    _clear_ignored_flags(module)


def build_with_sentinel(
    module: Module, build: Callable[[Module], DistributedDataParallel], size: int = 1
) -> tuple[DistributedDataParallel, Parameter, list[Parameter]]:
    """``build(module)`` with a sentinel of ``size`` values in DDP's last bucket (registered last, never in the
    state_dict or optimizer); returns the wrapper, the sentinel and the reducer's parameters."""
    sentinel = Parameter(torch.zeros(size, device=next(module.parameters()).device))
    module.register_parameter(SENTINEL, sentinel)
    try:
        ddp = build(module)
        params = reducer_parameters(ddp)
    finally:
        torch_compat.unregister_parameter(module, SENTINEL)
    return ddp, sentinel, params


def _clear_ignored_flags(module: Module) -> None:
    for _, param in module.named_parameters():
        if hasattr(param, torch_compat.DDP_IGNORED_FLAG):
            delattr(param, torch_compat.DDP_IGNORED_FLAG)
