"""``comm_hook="auto"``: exact all-reduce and each compression hook tried for a few steps, the fastest kept
(``strategy.decisions["comm_hook"]``; ``strategy.comm_hook.measured_ms``). See docs/comm-hooks.md."""

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel

from lightning_solo.core.checks import check_int, check_number
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.comm.hooks import CommHook
from lightning_solo.ddp.trial import Trial

AUTO_CANDIDATES = (None, "fp16", "bf16", "powersgd")  # post-local-SGD changes the optimisation: never tried
_TRIAL_POWERSGD_START = 2  # compress from the third step, so that the timed steps measure the compression
_NOT_MEASURED_AGAIN = "; chosen before the checkpoint, not measured again"


def label(name: str | None) -> str:
    return "exact" if name is None else name


def decide_comm_hook(measured_ms: dict[str, float], min_gain: float = 0.05) -> Decision:
    """The fastest of the measured ms per step, a hook only when ``min_gain`` faster than ``"exact"``."""
    table = ", ".join(f"{name} {ms:.2f}" for name, ms in measured_ms.items())
    where = f"ms per step, the fastest step of the slowest rank: {table}"
    fastest = min(measured_ms, key=measured_ms.__getitem__)
    exact = measured_ms.get("exact")
    if fastest == "exact" or (exact is not None and measured_ms[fastest] > exact * (1 - min_gain)):
        return Decision("comm_hook", None, f"auto: kept exact all-reduce, no hook was {min_gain:.0%} faster ({where})")
    return Decision("comm_hook", fastest, f"auto: {fastest} was the fastest ({where})")


def make_comm_hook(
    name: str | None, ddp_kwargs: Mapping[str, Any] | None = None, *, rewraps: bool = False, **options: Any
) -> CommHook:
    """SoloDDP's ``comm_hook=``: :class:`AutoCommHook` for ``"auto"``, else :class:`CommHook`, checked against
    ``ddp_kwargs``; ``rewraps``: DDP may be re-wrapped."""
    ddp_kwargs = ddp_kwargs or {}
    what = "a positive number of megabytes (DDP's default is 25) or None for the default"  # DDP takes <= 0, then fails
    check_number("bucket_cap_mb", ddp_kwargs.get("bucket_cap_mb"), optional=True, what=what)
    if name is not None and ddp_kwargs.get("ddp_comm_hook") is not None:
        raise ValueError("pass either comm_hook= or Lightning's ddp_comm_hook= to SoloDDP, not both")
    if rewraps and type(ddp_kwargs.get("ddp_comm_state")) is PowerSGDState:
        raise ValueError(
            "torch's PowerSGDState keys its error feedback to DDP's bucket layout, which changes when "
            "find_unused_parameters='auto' re-wraps DDP: use SoloDDP(comm_hook='powersgd') (the same "
            "algorithm, carried across re-wraps and checkpoints), or set find_unused_parameters=True/False"
        )
    options = {k: v for k, v in options.items() if v is not None}
    return AutoCommHook(**options) if name == "auto" else CommHook(name, **options)


class AutoCommHook(CommHook):
    """A :class:`CommHook` whose hook is chosen by a :class:`~lightning_solo.ddp.trial.Trial` of ``candidates``
    (``None``: exact all-reduce), ``warmup_steps`` untimed and ``trial_steps`` timed steps each; a hook is kept when
    ``min_gain`` faster than exact. ``**options``: :class:`CommHook`'s, for the chosen hook."""

    def __init__(
        self,
        candidates: tuple[str | None, ...] = AUTO_CANDIDATES,
        *,
        warmup_steps: int = 2,
        trial_steps: int = 5,
        min_gain: float = 0.05,
        **options: Any,
    ) -> None:
        super().__init__(None, **options)
        for name in candidates:
            CommHook(name)  # the same check of each name
        self.candidates = tuple(dict.fromkeys((None, *candidates)))  # exact first, always measured
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        self.trial_steps = check_int("trial_steps", trial_steps)
        self.min_gain = check_number("min_gain", min_gain, positive=False)
        self._start_iter = self.powersgd_start_iter
        self.measured_ms: dict[str, float] = {}
        self._index = 0
        self.trial = self._new_trial()
        self._waiting: tuple[Any, Any] | None = None  # a checkpoint's hook state, for the winner
        self._decision: Decision | None = None  # the hook kept, and why; None while measuring

    def _new_trial(self, times: Sequence[float] = (), stepped: bool = False) -> Trial:
        timed = [False] * self.warmup_steps + [True] * self.trial_steps
        return Trial([label(name) if t else None for name in self.candidates for t in timed], times, stepped)

    @property
    def decided(self) -> bool:
        """The hook is chosen (measured, or taken from a checkpoint)."""
        return self._decision is not None

    def register(self, ddp: DistributedDataParallel, *, node: Any = None) -> Decision:
        if not self.decided and dist.get_world_size(ddp.process_group) == 1:
            self._keep(Decision("comm_hook", None, "auto: one process, nothing to communicate"))
        registered = super().register(ddp, node=node)
        if self._decision is not None:
            return self._decision
        step = f"{self._index + 1}/{len(self.candidates)}"
        return Decision("comm_hook", "auto", f"auto: measuring {label(self.name)} ({step}); {registered.reason}")

    def step_hooks(self) -> dict[str, Callable[..., Any]]:
        """While measuring: every batch start (a re-wrap between candidates) and step end."""
        if self.decided:
            return super().step_hooks()
        return {"boundary": lambda strategy: self.at_boundary(strategy.root_device),
                "after_step": lambda strategy, optimizer: self.trial.step_end(strategy.root_device)}  # fmt: skip

    def at_boundary(self, device: torch.device) -> bool:
        """At every batch start, on every rank (a collective at the trial's end). True: re-wrap DDP now."""
        if not self.trial.batch_start(device) or len(self.trial.times) % (self.warmup_steps + self.trial_steps):
            return False
        self._index += 1
        if self._index < len(self.candidates):
            self._switch_to(self.candidates[self._index], _TRIAL_POWERSGD_START)
            return True
        self.measured_ms = {arm: min(times) * 1e3 for arm, times in self.trial.agree(device).items()}
        self._keep(decide_comm_hook(self.measured_ms, self.min_gain))
        return True

    def _keep(self, decision: Decision) -> None:
        self._decision = decision
        self._switch_to(decision.value, self._start_iter)
        if self._waiting is not None:
            super().load_state_dict(*self._waiting)
            self._waiting = None

    def _switch_to(self, name: str | None, powersgd_start_iter: int) -> None:
        self.name, self.powersgd_start_iter = name, powersgd_start_iter
        self.state = self.hook = None  # a fresh hook on the next wrapper

    def state_dict(self, checkpoint_path: Any = None, replica: dict[str, Any] | None = None) -> dict[str, Any]:
        """:meth:`CommHook.state_dict`, with ``"auto"``: the choice and its measurement, or the trial so far."""
        saved = super().state_dict(checkpoint_path, replica)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        record: dict[str, Any] = {"world_size": world, "candidates": [label(n) for n in self.candidates]}
        if self._decision is not None:
            record.update(decided=True, name=self.name, reason=self._decision.reason, measured_ms=self.measured_ms)
        else:
            record.update(decided=False, index=self._index, times=list(self.trial.times), stepped=self.trial.stepped)
        return {**saved, "auto": record}

    def load_state_dict(self, saved: dict[str, Any] | None, checkpoint_path: Any = None) -> None:
        """Take back :meth:`state_dict`'s result: the choice, or the trial where it was (docs/comm-hooks.md)."""
        saved = dict(saved or {})
        record = saved.pop("auto", None)
        if record is not None and self._resumable(record):
            self._waiting = None
            if record["decided"]:
                reason = record["reason"].removesuffix(_NOT_MEASURED_AGAIN) + _NOT_MEASURED_AGAIN
                self.measured_ms = dict(record["measured_ms"])
                self._keep(Decision("comm_hook", record["name"], reason))
            else:
                self._decision, self.measured_ms, self._index = None, {}, record["index"]
                self.trial = self._new_trial(record["times"], record["stepped"])
                self._switch_to(self.candidates[self._index], _TRIAL_POWERSGD_START)
            if saved:
                super().load_state_dict(saved, checkpoint_path)
        elif self.decided:
            super().load_state_dict(saved, checkpoint_path)
        elif saved:
            self._waiting = (saved, checkpoint_path)  # applied if the same hook wins again

    def _resumable(self, record: dict[str, Any]) -> bool:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        if record["candidates"] != [label(n) for n in self.candidates]:
            why = f"other candidates ({', '.join(record['candidates'])})"
        elif None not in (world, record["world_size"]) and world != record["world_size"]:
            why = f"{record['world_size']} ranks, this run has {world}"
        else:
            return True
        warnings.warn(f"the checkpoint's comm_hook='auto' was measured with {why}: measuring again", stacklevel=3)
        return False
