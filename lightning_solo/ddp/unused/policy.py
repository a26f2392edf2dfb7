"""``find_unused_parameters="auto"``: DDP's fast path when every parameter gets a gradient, exactly ``True``'s
result when some do not. See docs/unused-parameters.md (with an example on a bare DDP)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_warn
from torch.nn import Module, Parameter
from torch.nn.parallel import DistributedDataParallel

from lightning_solo.core.checks import check_bool, check_choice, check_int
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.syncbn.layer import backward_collectives
from lightning_solo.ddp.unused import surgery as ddp_surgery
from lightning_solo.ddp.unused.fast_path import FastPathStep
from lightning_solo.ddp.unused.surgery import (
    build_with_sentinel,
    ddp_ignore_list,
    restore_ignore_list,
    trainable,
    unwrap_excluding,
)
from lightning_solo.ddp.unused.watch import quiet_search_note, search_safe_checkpointing, watch_collectives
from lightning_solo.ddp.unused.window import UsageWindow

FindUnused = bool | Literal["auto"]
FIND_UNUSED_VALUES = (True, False, "auto")


class Phase(StrEnum):
    USER = "user"  # the user's True/False (or static_graph): never changed
    WINDOW = "window"  # gathering evidence on True
    FAST = "fast"  # False: every parameter synchronised
    EXCLUDING = "excluding"  # False: parameters never used are left out of synchronisation
    SEARCHING = "searching"  # True from here on: DDP searches the graph every step


class UnusedParameters:
    """SoloDDP's ``find_unused_parameters`` policy: ``setting`` ("auto", True or False), ``window`` (synchronised
    steps of evidence), ``static_graph`` (the user's; "auto" then stays out of the way), ``follow_trainable``
    (re-wrap DDP when parameters are frozen or unfrozen mid-fit: SoloDDP's ``rewrap_on_trainable_change``)."""

    def __init__(
        self,
        setting: FindUnused = "auto",
        *,
        window: int = 4,
        static_graph: bool = False,
        follow_trainable: bool = True,
    ) -> None:
        hint = " ('auto': the fast path unless parameters go unused, decided from the first steps)"
        self.setting: FindUnused = check_choice("find_unused_parameters", setting, FIND_UNUSED_VALUES, hint)
        self.window, self.static_graph = check_int("window", window), static_graph
        self.follow_trainable = check_bool("rewrap_on_trainable_change", follow_trainable)
        self.follow_decision = Decision(
            "rewrap_on_trainable_change", follow_trainable,
            "DDP re-wrapped when parameters are frozen or unfrozen mid-fit, so every trainable one is synchronised"
            if follow_trainable else "set by the user: as stock, a layer unfrozen mid-fit is not synchronised",
        )  # fmt: skip
        self.unused_names: list[str] = []  # never received a gradient during the window (excluded)
        self.varying_names: list[str] = []  # without a gradient on some steps or ranks only
        self.unused_bytes = 0
        self.steps = 0  # synchronised backward passes in this fit
        if setting != "auto":
            self.phase, self.find_unused = Phase.USER, bool(setting)
            self.decision = Decision("find_unused_parameters", self.find_unused, "set by the user")
        elif static_graph:
            self.phase, self.find_unused = Phase.USER, False
            self.decision = Decision(
                "find_unused_parameters", False, "static_graph=True: DDP tracks a fixed set of unused parameters itself"
            )
        else:
            self.phase, self.find_unused = Phase.WINDOW, True
            self.decision = Decision(
                "find_unused_parameters", "auto", f"deciding from the first {window} steps (on True meanwhile)"
            )
        self.initial = self.find_unused
        self._named: tuple[tuple[str, Parameter], ...] = ()  # trainable parameters at bind: "our" indices
        self._trainable_flags: list[tuple[Parameter, bool]] = []
        self._to_ours: list[int] = []  # reducer index -> our index, for the current DDP wrapper
        self._ignored: list[int] = []  # ours, excluded from synchronisation
        self._user_ignore: list[str] | None = None
        self._group: Any = None
        self._fast: FastPathStep | None = None  # on the fast path: its per-step completion
        self._evidence = UsageWindow()
        self._backward_collective: str | None = None  # why collectives run inside backward, once known
        self._switch: str | None = None  # why the fast path must end: switch to True at the next boundary
        self._probe = False  # the window's wrapper holds the probe parameter

    def fresh(self) -> UnusedParameters:
        """A policy with the same settings and no evidence: every fit decides from its own steps."""
        return UnusedParameters(
            self.setting, window=self.window, static_graph=self.static_graph, follow_trainable=self.follow_trainable
        )

    @property
    def in_window(self) -> bool:
        """Still gathering evidence: a re-wrap is pending."""
        return self.phase is Phase.WINDOW

    @property
    def on_fast_path(self) -> bool:
        """On DDP's fast path (``False``), with a side channel for what runs apart from DDP's buckets."""
        return self.phase in (Phase.FAST, Phase.EXCLUDING)

    def step_context(self, note_reentrant: Callable[[], None]) -> contextlib.AbstractContextManager[Any]:
        """Around a training step: while "auto" has DDP searching, reentrant checkpointing runs non-reentrant."""
        searching = self.phase in (Phase.WINDOW, Phase.SEARCHING)  # "auto" has DDP search, not the user
        return search_safe_checkpointing(note_reentrant) if searching else contextlib.nullcontext()

    def backward_context(self) -> contextlib.AbstractContextManager[Any]:
        """Around backward: in the window, the evidence of a collective inside backward."""
        return watch_collectives(self.note_backward_collective) if self.in_window else contextlib.nullcontext()

    def bind(self, ddp: DistributedDataParallel, group: Any = None, *, sentinel: Parameter | None = None,
             reducer_parameters: list[Parameter] | None = None) -> DistributedDataParallel:  # fmt: skip
        """Bind a new DDP wrapper (:meth:`wrap` and :meth:`rebuild` do). ``group``: a gloo group apart from DDP's."""
        self.stop()
        self._group = group
        self._named = trainable(ddp.module)
        self._trainable_flags = [(p, p.requires_grad) for p in ddp.module.parameters()]  # checked every batch
        index = {id(p): i for i, (_, p) in enumerate(self._named)}
        self._to_ours = [index.get(id(p), -1) for p in reducer_parameters or ddp_surgery.reducer_parameters(ddp)]
        self._check_layers(ddp.module)
        if self.phase is Phase.SEARCHING:
            quiet_search_note(group)
        if self.phase in (Phase.FAST, Phase.EXCLUDING):
            self._fast = FastPathStep(
                self._named,
                [i for i in self._to_ours if i >= 0],
                self._ignored,
                group,
                # Excluded parameters may get a gradient until the very end of backward: no early signal then.
                signal_early=self.phase is Phase.FAST,
                sentinel=sentinel,
                ddp=ddp,
                # by identity: list.index compares tensors with ==
                sentinel_index=next((i for i, p in enumerate(reducer_parameters or []) if p is sentinel), -1),
            )
        return ddp

    def rebuild(self, module: Module, build: Callable[[Module], DistributedDataParallel], group: Any = None, *,
                exact_allreduce: bool = True) -> DistributedDataParallel:  # fmt: skip
        """``build`` and bind the next wrapper of ``module``; on the fast path with ``exact_allreduce`` (no comm hook)
        with the usage sentinel in DDP's last bucket."""
        if self.phase is Phase.WINDOW:
            return self.wrap(module, build, group, probe=exact_allreduce)
        if self.phase not in (Phase.FAST, Phase.EXCLUDING) or not exact_allreduce:
            return self.bind(build(module), group)
        new, sentinel, params = build_with_sentinel(module, build, len(trainable(module)))
        return self.bind(new, group, sentinel=sentinel, reducer_parameters=params)

    def wrap(self, module: Module, build: Callable[[Module], DistributedDataParallel], group: Any = None, *,
             probe: bool = True) -> DistributedDataParallel:  # fmt: skip
        """``build(module)`` and bind it; in the window (and ``probe``) with an unused probe parameter, so that DDP's
        search never notes that it found nothing unused."""
        self._check_layers(module)  # SyncBN found: on True for good, built without the probe
        self._probe = self.phase is Phase.WINDOW and probe
        if not self._probe:
            return self.bind(build(module), group)
        new, _, params = build_with_sentinel(module, build)
        return self.bind(new, group, reducer_parameters=params)

    def note_backward_collective(self, what: str) -> None:
        """A collective runs inside this step's backward: on the fast path, ``True`` from the next batch."""
        if self._backward_collective is None and self.phase is not Phase.USER:
            self._backward_collective = what
            if self.phase in (Phase.FAST, Phase.EXCLUDING) and self._switch is None:
                self._switch = f"{what} communicates inside backward"

    def before_backward(self, ddp: Module) -> None:
        if self._fast is not None and getattr(ddp, "require_backward_grad_sync", False):
            self._fast.arm()

    def after_backward(self, ddp: Module) -> None:
        """Right after every backward, on every rank, before any other collective and the optimizer step."""
        if not isinstance(ddp, DistributedDataParallel) or not ddp.require_backward_grad_sync:
            return  # not wrapped, or inside no_sync (accumulation): the reducer is not involved
        self.steps += 1
        if self.phase is Phase.WINDOW:
            self._evidence.add(ddp, self._to_ours, len(self._named))
        elif self._fast is not None:
            self._note_event(self._fast.complete(ddp, self.steps - 1))

    def at_boundary(self, ddp: Module) -> bool:
        """At a batch boundary, on every rank. True: re-wrap now (:meth:`unwrap`, then :meth:`rebuild`)."""
        if not isinstance(ddp, DistributedDataParallel):
            return False
        if self.follow_trainable and any(p.requires_grad is not was for p, was in self._trainable_flags):
            self._trainable_set_changed(ddp.module)
            return True
        if self.phase is Phase.WINDOW and self._evidence.steps >= self.window:
            return self._decide() or self._probe  # the probe leaves DDP whatever the decision
        if self._switch is not None:
            self._search(f"{self._switch}: switched to find_unused_parameters=True from step {self.steps}")
            self._switch = None
            return True
        return False

    def unwrap(self, ddp: DistributedDataParallel, keep_grads: bool = False) -> Module:
        """Detach ``ddp`` from its module, marking the parameters to exclude; returns the bare module."""
        self.stop()
        if self._user_ignore is None:
            self._user_ignore = ddp_ignore_list(ddp.module)
        return unwrap_excluding(ddp, [self._named[i][0] for i in self._ignored], self._user_ignore, keep_grads)

    def finish(self, ddp: Module) -> None:
        """At the end of fit, on every rank: the late read taken, hooks removed, the user's ignore list back."""
        if self._fast is not None:
            self._note_event(self._fast.pending())
        self.stop()
        if self._user_ignore is not None:
            restore_ignore_list(getattr(ddp, "module", ddp), self._user_ignore)
        if self.phase is Phase.WINDOW and self._evidence.steps:
            self.decision = Decision(
                "find_unused_parameters", True,
                f"the fit ended within the evidence window ({self._evidence.steps} of {self.window} steps): True throughout",
            )  # fmt: skip
        if self._switch is not None:
            self.decision = Decision(
                "find_unused_parameters", False, f"{self._switch}: the fit ended before switching to True"
            )

    def reducer_name(self, index: int) -> str | None:
        """The name of the parameter at DDP's reducer ``index`` in the current wrapper (None: not ours)."""
        ours = self._to_ours[index] if 0 <= index < len(self._to_ours) else -1
        return self._named[ours][0] if ours >= 0 else None

    def _note_event(self, event: tuple[int, list[str]] | None) -> None:
        if event is None:
            return
        step, names = event
        self.varying_names = sorted(set(self.varying_names) | set(names))
        if self._switch is None:
            self._switch = (
                f"after the evidence window, {len(names)} parameters went without a gradient on some rank at "
                f"step {step} ({', '.join(names)}); that step was completed as True would have"
            )
            rank_zero_warn(f"SoloDDP: {self._switch}; switching to find_unused_parameters=True")

    def _check_layers(self, module: Module) -> None:
        if self.phase is Phase.WINDOW and (found := backward_collectives(module)):
            more = ", ..." if len(found) > 3 else ""
            self._backward_collective = f"{len(found)} SyncBatchNorm-like layers ({', '.join(found[:3])}{more})"
            self._search(f"{self._backward_collective} communicate inside backward")

    def stop(self) -> None:
        """Remove the per-parameter hooks (also when an exception ended the fit)."""
        if self._fast is not None:
            self._fast.remove()
            self._fast = None

    def _decide(self) -> bool:
        never, varying = self._evidence.never(), self._evidence.varying()
        self.unused_names = [self._named[i][0] for i in never]
        self.varying_names = [self._named[i][0] for i in varying]
        self.unused_bytes = sum(self._named[i][1].numel() * self._named[i][1].element_size() for i in never)
        steps = f"the first {self._evidence.steps} steps"
        if self._backward_collective is not None:
            self._search(f"{self._backward_collective} communicates inside backward")
            return False
        if self._group is None:
            self._search("no CPU-side (gloo) group for the fast path's per-step check")
            return False
        if varying or len(never) == len(self._named):
            self._search(f"{len(varying)} parameters got no gradient on some steps or ranks only in {steps}")
            never_part = f"; never: {', '.join(self.unused_names)}" if never else ""
            rank_zero_warn(
                "SoloDDP: find_unused_parameters=True, because these parameters received no gradient on some "
                f"steps or ranks only: {', '.join(self.varying_names)}{never_part}"
            )
            return False
        self.find_unused, self._ignored = False, never
        if not never:
            self.phase = Phase.FAST
            self.decision = Decision(
                "find_unused_parameters", False,
                f"every parameter got a gradient on every rank in {steps}: DDP's fast path (a per-step check "
                "completes any later step exactly as True would, then switches at the next batch; no host sync "
                "on a step where this rank got every gradient: find_unused_parameters=False skips the check)",
            )  # fmt: skip
            return True
        self.phase = Phase.EXCLUDING
        self.decision = Decision(
            "find_unused_parameters", False,
            f"{len(never)} parameters ({self.unused_bytes / 2**20:.2f} MiB) got no gradient on any rank in "
            f"{steps}: excluded from synchronisation, fast path for the rest (its check reads one value after "
            "each backward, a host sync per step on GPUs)",
        )  # fmt: skip
        rank_zero_warn(
            f"SoloDDP: these parameters received no gradient in {steps} and are excluded from DDP's "
            f"synchronisation (freeze or remove them to save the memory): {', '.join(self.unused_names)}"
        )
        return True

    def _search(self, why: str) -> None:
        self.phase, self.find_unused, self._ignored = Phase.SEARCHING, True, []
        self.decision = Decision(
            "find_unused_parameters", True, f"{why}: DDP searches the graph for unused parameters every step"
        )

    def _trainable_set_changed(self, module: Module) -> None:
        before = {n for n, _ in self._named}
        after = {n for n, _ in trainable(module)}
        change = f"+{len(after - before)}/-{len(before - after)} trainable parameters at step {self.steps}"
        self._ignored, self._switch = [], None
        if self.phase is Phase.USER:
            self.decision = Decision(
                "find_unused_parameters", self.find_unused,
                f"set by the user; DDP re-wrapped after {change}, so every trainable parameter is synchronised",
            )  # fmt: skip
            return
        self.phase, self.find_unused = Phase.WINDOW, True
        self._evidence = UsageWindow()
        self.decision = Decision(
            "find_unused_parameters", "auto",
            f"{change}: DDP re-wrapped so every trainable parameter is synchronised; deciding again from the "
            f"next {self.window} steps (on True meanwhile)",
        )  # fmt: skip
