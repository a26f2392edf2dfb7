"""``SoloDDP(compile=...)``: the LightningModule's steps compiled inside DDP's forward, re-wraps that cost no
recompile, and ``"auto"``, which keeps compile only when the measured gain pays for it within the planned run
(``SoloDDP(compile=True | "auto" | {"mode": ...})``; ``fit(torch.compile(model))`` takes the same path). See
docs/compile.md."""

from __future__ import annotations

import contextlib
import inspect
import math
import statistics
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.compile import from_compiled, to_uncompiled
from torch.nn.parallel import DistributedDataParallel

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo._compat import torch as torch_compat
from lightning_solo._compat.patch import Patches
from lightning_solo.core.checks import check_choice
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.trial import Trial

CompileSetting = bool | Literal["auto"] | Mapping[str, Any]
COMPILE_VALUES = (False, True, "auto")
_COMPILE_OPTIONS = tuple(p for p in inspect.signature(torch.compile).parameters if p != "model")
# Eager inside a compiled step: traced, ``self.log`` recompiles the step per new metric key (docs/compile.md).
_EAGER_METHODS = ("log", "log_dict")

_WAITING, _TRIAL, _SETTLED = "waiting", "trial", "settled"
_STOCK = Decision("compile", False, "stock: the steps run eagerly")
_TIMED_STEPS = 3  # "auto"'s timed compiled and eager steps each, interleaved, after the compiling one


def decide_compile(compiled_ms: float, eager_ms: float, compile_s: float, planned_steps: float,
                   timed: int) -> Decision:  # fmt: skip
    """Keep compile when the steady gain per step, over the planned optimizer steps, pays back the compile
    time: ``(eager - compiled) * planned_steps >= compile_s``. Pure: every rank passes the same numbers."""
    gain_s = (eager_ms - compiled_ms) / 1e3
    payback = compile_s / gain_s if gain_s > 0 else math.inf
    keep = gain_s > 0 and payback <= planned_steps
    planned = "an unbounded run" if math.isinf(planned_steps) else f"{planned_steps:.0f} planned steps"
    pays = f"pays back after {payback:.0f} steps" if gain_s > 0 else "no steady gain"
    measured = f"compiled step {compiled_ms:.2f} ms vs eager {eager_ms:.2f} ms (medians of {timed} each, interleaved"
    outcome = f"{pays}, {planned} -> " + ("compiled" if keep else "eager for the rest of the fit")
    return Decision("compile", keep, f"auto: {measured}, slowest rank), compile {compile_s:.2f} s: {outcome}")


class CompiledSteps:
    """The ``compile=`` component of :class:`~lightning_solo.SoloDDP`: ``setting`` ``False`` (stock: eager, unless
    the user passed ``torch.compile(model)``), ``True``, ``"auto"``, or a dict of ``torch.compile`` options (``True``
    with them)."""

    def __init__(self, setting: CompileSetting = False) -> None:
        if isinstance(setting, Mapping):
            options = dict(setting)
            if unknown := sorted(set(options) - set(_COMPILE_OPTIONS)):
                raise ValueError(f"compile={options!r}: not torch.compile options: {unknown} ({_COMPILE_OPTIONS})")
            self.setting: bool | str = True
            self.options = options
        else:
            hint = " (or a dict of torch.compile options)"
            self.setting, self.options = check_choice("compile", setting, COMPILE_VALUES, hint), {}
        self.decision = _STOCK if self.setting is False else Decision("compile", self.setting, "compiled at setup")
        self.fallback: Decision | None = None
        self._module: Any = None  # the LightningModule whose steps are compiled (by us or by the user)
        self._ours = False  # compiled here: uncompiled at teardown
        self._patches = Patches()  # the module's eager log/log_dict
        self._state = _SETTLED
        self._trial = Trial(["compile", *(["eager", "compiled"] * _TIMED_STEPS)])  # "auto"'s, per optimizer step
        self._after_first = False  # the first compiled training step is done
        self._ran_compiled = False  # a training step of the current optimizer step ran compiled
        self._ordered: weakref.ref | None = None  # the DDP wrapper whose buckets an eager step ordered
        self.recompiles = 0  # frames Dynamo compiled in training steps after the first compiled one
        self._steps = 0  # optimizer steps in this fit
        self._failed_seen = 0

    def fresh(self) -> CompiledSteps:
        """The same settings, nothing measured: every fit decides again."""
        return CompiledSteps(self.options or self.setting)  # type: ignore[arg-type]

    @property
    def compiled(self) -> bool:
        """The training steps run compiled (from now on, or once "auto"'s trial starts)."""
        return self._module is not None

    def setup(self, module: Any) -> Decision:
        """At a fit's setup, on every rank, before DDP wraps ``module``."""
        self._failed_seen = _frames_failed()
        users = lightning_compat.compiled_by_user(module)
        if self.setting is False and not users:
            self.decision = _STOCK
            return self.decision
        if users:
            how = "fit(torch.compile(model)): Lightning compiled the steps with the user's options"
            how += f" (compile={self.options!r} unused)" if self.options else ""
        else:
            # "auto" compiles when its trial starts: eager until then, the validations in between too.
            if self.setting is True:
                self._compile(module)
            how = f"torch.compile({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"
        self._module = module
        log, order = "self.log traced, as stock", ""
        if self.setting is not False:  # compile=False leaves the user's compile as Lightning applied it
            for name in _EAGER_METHODS:
                self._patches.set(module, name, torch.compiler.disable(getattr(module, name), recursive=True))
            log = "self.log eager"
            order = "; each DDP wrapper's first synchronising step runs eagerly, so its buckets follow eager's order"
        where = (
            f"{how}: training_step compiled inside DDP's forward (the LightningModule, not the wrapper; {log}); "
            f"{_ddp_note()}{order}"
        )
        if self.setting == "auto":
            self._state = _WAITING
            self.decision = Decision(
                "compile", "auto", f"measuring once the unused-parameter policy and the comm hook settle; {where}"
            )
        else:
            self.decision = Decision("compile", True, f"{where}; re-wraps reuse the compiled code")
        return self.decision

    def step_hooks(self) -> dict[str, Callable[..., Any]]:
        """The step moments it takes part in (:mod:`lightning_solo.ddp.component`): none while the steps run eagerly
        as stock."""
        if not self.compiled:
            return {}
        return {"batch_start": self._batch_start, "step": lambda strategy: self.step_context(strategy.model),
                "after_step": lambda strategy, optimizer: self.after_step(strategy.root_device)}  # fmt: skip

    def _batch_start(self, strategy: Any) -> None:
        """At every batch start, on every rank alike: "auto"'s trial starts once no re-wrap is pending
        (``strategy.settled``) and the DDP wrapper's buckets are ordered, and decides at its end."""
        if (fallback := self._check_fallback()) is not None:
            strategy._decide(fallback)
        if self._state == _WAITING and strategy.settled and not self._orders_buckets(strategy.model):
            left, trial = _planned(strategy) - self._steps, len(self._trial.schedule)
            if left < trial:  # every rank alike: the same steps done and planned
                self._state = _SETTLED
                self.decision = Decision(
                    "compile", False, f"auto: {left:.0f} steps left, fewer than the {trial} of the trial: too short "
                    "to measure or pay back a compile -> eager",
                )  # fmt: skip
                self._restore(uncompile=True)
                strategy._decide(self.decision)
                return
            self._state = _TRIAL
            if not lightning_compat.compiled_by_user(self._module):
                self._compile(self._module)
        if self._state == _TRIAL and self._trial.batch_start(strategy.root_device) and self._trial.done:
            strategy._decide(self._decide(strategy))

    @contextlib.contextmanager
    def step_context(self, wrapper: Any = None) -> Iterator[None]:
        """Around each training step: eager before "auto"'s trial, on its eager arm and on the step that orders a DDP
        ``wrapper``'s buckets; counts :attr:`recompiles`."""
        if not self.compiled:  # stock: nothing read, nothing counted
            yield
            return
        orders = self._orders_buckets(wrapper)
        eager = orders or self._state == _WAITING or (self._state == _TRIAL and self._trial.arm == "eager")
        before = _frames_ok()
        with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
            yield
        if orders:
            self._ordered = weakref.ref(wrapper)
        self._ran_compiled |= not eager
        if self._after_first:
            self.recompiles += _frames_ok() - before

    def after_step(self, device: torch.device) -> None:
        """At the end of every optimizer step."""
        first = self._state == _SETTLED or (self._state == _TRIAL and self._trial.arm == "compile")
        self._steps += 1
        if not self._after_first and self.compiled and first and self._ran_compiled:
            self._after_first = True
        self._ran_compiled = False
        if self._state == _TRIAL:
            self._trial.step_end(device)

    def finish(self) -> Decision:
        """At the end of training: the decision with the recompiles counted."""
        self._check_fallback()
        if self.compiled and self._after_first:
            counted = f"; {self.recompiles} recompiles in training steps after the first compiled one"
            self.decision = Decision("compile", self.decision.value, self.decision.reason + counted)
        return self.decision

    def teardown(self) -> None:
        """Give the module back its own steps (when they were compiled here) and its own ``log``."""
        if self._module is not None:
            self._restore(uncompile=self._ours)

    def _decide(self, strategy: Any) -> Decision:
        times = self._trial.agree(strategy.root_device)  # the slowest rank's, per step
        compiled, eager = statistics.median(times["compiled"]), statistics.median(times["eager"])
        compile_s = max(times["compile"][0] - compiled, 0.0)
        self.decision = decide_compile(compiled * 1e3, eager * 1e3, compile_s, _planned(strategy), _TIMED_STEPS)
        self._state = _SETTLED
        if not self.decision.value and self._module is not None:
            self._restore(uncompile=True)  # Lightning's own undo of from_compiled (the user's compile too)
        return self.decision

    def _orders_buckets(self, wrapper: Any) -> bool:
        """This step is ``wrapper``'s first synchronising backward, where DDP orders its buckets (a reducer that
        searches for unused parameters keeps its own), so it runs eagerly; ``compile=False`` leaves stock's."""
        return (
            self.setting is not False
            and isinstance(wrapper, DistributedDataParallel)
            and (wrapper.static_graph or not wrapper.find_unused_parameters)
            and wrapper.require_backward_grad_sync
            and (self._ordered is None or self._ordered() is not wrapper)
        )

    def _compile(self, module: Any) -> None:
        from_compiled(torch.compile(module, **self.options))  # type: ignore[arg-type]  # an OptimizedModule
        self._ours = True

    def _restore(self, uncompile: bool) -> None:
        self._patches.close()
        if uncompile and lightning_compat.compiled_by_user(self._module):
            to_uncompiled(self._module)
        self._module, self._ours = None, False

    def _check_fallback(self) -> Decision | None:
        """A frame Dynamo gave up on runs eagerly (e.g. ``recompile_limit`` hit): said once, with the reason."""
        if not self.compiled or self.fallback is not None or _frames_failed() <= self._failed_seen:
            return None
        reasons = [key.split("\n")[0] for key in torch_compat.dynamo_counters()["unimplemented"]]
        limit = [r for r in reasons if "recompile limit" in r.lower()]
        why = "; ".join(limit or reasons[-3:] or ["Dynamo gave no reason"])
        reason = f"{_frames_failed() - self._failed_seen} frames ran eagerly (Dynamo could not compile them): {why}"
        self.fallback = Decision("compile_fallback", "eager", reason)
        return self.fallback


def _planned(strategy: Any) -> float:
    """The fit's planned optimizer steps (``inf``: unbounded), read only when "auto" needs them."""
    return float(strategy.lightning_module.trainer.estimated_stepping_batches)


def _frames_ok() -> int:
    return int(torch_compat.dynamo_counters()["frames"]["ok"])


def _frames_failed() -> int:
    frames = torch_compat.dynamo_counters()["frames"]
    return int(frames["total"] - frames["ok"])


def _ddp_note() -> str:
    mode = torch_compat.optimize_ddp()
    if mode is True or mode == "ddp_optimizer":
        return (
            "torch._dynamo.config.optimize_ddp: DDPOptimizer splits the graph at DDP's bucket boundaries, so each "
            "bucket's all-reduce overlaps the rest of backward"
        )
    return f"torch._dynamo.config.optimize_ddp={mode!r} (set by the user): not DDPOptimizer's split"
