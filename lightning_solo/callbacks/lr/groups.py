"""The param groups as WarmupScaledLR drives them: the user's lr × a factor around each step. See docs/lr-scaling.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class ScaledParamGroups:
    """``factor()`` applied to and taken off every param group; ``user_lrs``: the user's lr per optimizer, group."""

    def __init__(self, optimizers: Sequence[Any], user_lrs: list[list[float]], factor: Callable[[], float]) -> None:
        self.optimizers, self.user_lrs, self.factor = list(optimizers), user_lrs, factor
        self.applied = [False] * len(self.optimizers)
        self.in_step = [False] * len(self.optimizers)
        for opt, lrs in zip(self.optimizers, user_lrs):
            for g, lr in zip(opt.param_groups, lrs):
                g["lr"] = lr
        self._hooks = []
        for i, opt in enumerate(self.optimizers):
            self._hooks.append(opt.register_step_pre_hook(lambda o, a, k, i=i: self._enter_step(i)))
            self._hooks.append(opt.register_step_post_hook(lambda o, a, k, i=i: self._leave_step(i)))

    def apply_all(self) -> None:
        for i in range(len(self.optimizers)):
            self.apply(i)

    def unapply_all(self) -> None:
        for i in range(len(self.optimizers)):
            self.unapply(i)

    def apply(self, i: int) -> None:
        """Param groups of optimizer ``i`` := user lr × factor, reading the user lr first."""
        if self.applied[i]:
            return
        factor = self.factor()
        groups = self.optimizers[i].param_groups
        self.user_lrs[i] = [g["lr"] for g in groups]  # picks up whatever the user's scheduler set
        for g, lr in zip(groups, self.user_lrs[i]):
            g["lr"] = lr * factor
        self.applied[i] = True

    def unapply(self, i: int) -> None:
        if not self.applied[i]:
            return
        for g, lr in zip(self.optimizers[i].param_groups, self.user_lrs[i]):
            g["lr"] = lr
        self.applied[i] = False

    def unapply_outside_step(self, optimizer: Any) -> None:
        """``optimizer``'s groups (it may be Lightning's wrapper) back to the user's lr unless inside its step."""
        for i, opt in enumerate(self.optimizers):
            if (opt is optimizer or getattr(optimizer, "optimizer", None) is opt) and not self.in_step[i]:
                self.unapply(i)

    def current_user_lrs(self) -> list[list[float]]:
        """The user's lr now: between a step and the next batch a scheduler may have moved it (read it there)."""
        return [
            list(lrs) if self.applied[i] else [g["lr"] for g in opt.param_groups]
            for i, (opt, lrs) in enumerate(zip(self.optimizers, self.user_lrs))
        ]

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _enter_step(self, i: int) -> None:
        self.apply(i)
        self.in_step[i] = True

    def _leave_step(self, i: int) -> None:
        self.in_step[i] = False
        self.unapply(i)


def lr_names(optimizers: Sequence[Any]) -> list[list[str]]:
    """LearningRateMonitor's names for each param group: lr-SGD, lr-SGD-1, lr-SGD/pg2 or the group's ``name``."""
    names: list[list[str]] = []
    seen: dict[str, int] = {}
    for opt in optimizers:
        cls = type(opt).__name__
        base = f"lr-{cls}" + (f"-{seen[cls]}" if cls in seen else "")
        seen[cls] = seen.get(cls, 0) + 1
        groups = opt.param_groups
        if len(groups) == 1:
            names.append([base + (f"/{groups[0]['name']}" if "name" in groups[0] else "")])
        else:
            names.append([f"{base}/{g.get('name', f'pg{j + 1}')}" for j, g in enumerate(groups)])
    return names
