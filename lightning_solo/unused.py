"""``find_unused_parameters="auto"``: DDP's fast path when every parameter gets a gradient, and no crash when
some do not.

Stock DDP makes you choose up front. ``False`` (the fast path) crashes with "Expected to have finished
reduction in the prior iteration" as soon as one parameter goes without a gradient; ``True`` is correct for
any model but searches the autograd graph and all-reduces a usage map on every step. ``"auto"`` decides from
evidence, once, the same way on every rank:

1. **Evidence window.** The first ``window`` synchronised backward passes run on the fast path with a
   safety net (step 3). After each, one small all-reduce tells every rank which parameters went without a
   gradient on which ranks; a parameter that no rank used has its gradient reset to ``None``, exactly what
   ``find_unused_parameters=True`` does.
2. **Decision** (at the next batch boundary, identical on all ranks because the evidence is all-reduced):

   * every parameter used on every rank -> stay on the fast path (``False``), no re-wrap;
   * the same parameters unused on every step and rank (a head never called) -> name them in one warning,
     exclude them from synchronisation and re-wrap on the fast path;
   * anything else (a branch taken on some steps or ranks only) -> name them, re-wrap with ``True``.

3. **Safety net on the fast path** (one C++ flag check per step): when a parameter first goes unused after
   the window, DDP's reducer is left unfinished on that rank (and a rank that used it waits in its gradient
   all-reduce). The rank finishes it by feeding zero gradients for exactly the missing parameters (DDP's
   error lists their indices; should its wording change, those whose gradient is ``None``), which is
   what ``True`` contributes for a locally unused parameter, so all ranks' all-reduces line up and nothing
   crashes or hangs. An excluded parameter that gets a gradient has it discarded on every rank that has one
   (no rank applies it, so the ranks stay identical). A small asynchronous all-reduce shares these events
   and is read one period later, long finished, so nobody waits on it; if there were any, all ranks re-wrap
   with ``True`` at the next batch boundary and warn with the names. The period starts at ``check_every``
   steps and, on the all-used fast path, doubles after every clean check up to ``16 * check_every`` (the
   check's cost fades away; a late event switches within two periods). With excluded parameters it stays at
   ``check_every``, since their discarded gradients are the costlier event. Until the switch, a parameter
   unused on *every* rank in a step gets a zero gradient instead of ``None`` (identical for plain SGD;
   momentum and weight decay see a zero step).

``static_graph`` is never switched on automatically: it promises that the graph can never change, which is
the one thing "auto" cannot know. The end-of-fit advice says when DDP saw a static graph.

Example::

    policy = UnusedParameters("auto")
    ddp = DistributedDataParallel(model, find_unused_parameters=policy.initial)
    for step, batch in enumerate(loader):
        if policy.at_boundary(ddp):                      # re-wrap decided (same on every rank)
            ddp = DistributedDataParallel(policy.unwrap(ddp), find_unused_parameters=policy.find_unused)
        loss = ddp(batch).sum()
        loss.backward()
        policy.after_backward(ddp)                       # evidence / safety net; before optimizer.step()
        optimizer.step(); optimizer.zero_grad()
    policy.finish(ddp)                                   # every rank, at the end
    print(policy.decision)
"""

from __future__ import annotations

import re
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn import Module, Parameter
from torch.nn.parallel import DistributedDataParallel

from lightning_solo.decision import Decision

FindUnused = bool | Literal["auto"]
FIND_UNUSED_VALUES = (True, False, "auto")
# DDP's unfinished-reduction error lists the parameter indices (reducer order) that got no gradient here.
_MISSING_INDICES = re.compile(r"did not receive grad for rank \d+: ([\d ,]+)")


def check_find_unused(value: Any) -> FindUnused:
    """Return ``value`` if it is an accepted ``find_unused_parameters``, else raise ``ValueError``."""
    if not any(value is accepted or (isinstance(value, str) and value == accepted) for accepted in FIND_UNUSED_VALUES):
        raise ValueError(
            f"find_unused_parameters={value!r} is not accepted: use one of {FIND_UNUSED_VALUES} "
            "('auto': the fast path unless parameters go unused, decided from the first steps)"
        )
    return value


def _reducer_parameters(ddp: DistributedDataParallel) -> list[Parameter]:
    # The order of DDP's `_build_params_for_reducer` (module by module, deduplicated): the reducer's indices.
    # Its ignore test is f"{module_name}.{param_name}" ("." + name at the root), hence the same test here.
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


class UnusedParameters:
    """The ``find_unused_parameters`` policy of :class:`~lightning_solo.SoloDDP` (see the module docstring).

    Args:
        setting: ``"auto"``, ``True`` or ``False``. ``True``/``False`` are passed to DDP unchanged.
        window: synchronised backward passes of evidence before deciding.
        check_every: after the window, steps between the asynchronous event checks at first (doubling up
            to ``16 * check_every`` while nothing happens, on the all-used fast path).
        static_graph: the user's DDP ``static_graph``; DDP then tracks a fixed unused set itself and "auto"
            stays out of the way.
    """

    def __init__(self, setting: FindUnused = "auto", *, window: int = 4, check_every: int = 4,
                 static_graph: bool = False) -> None:
        self.setting = check_find_unused(setting)
        for name, value in (("window", window), ("check_every", check_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not accepted: use an integer >= 1")
        self.window, self.check_every = window, check_every
        self.unused_names: list[str] = []  # never received a gradient during the window (excluded if static)
        self.varying_names: list[str] = []  # without a gradient on some steps or ranks only
        self.unused_bytes = 0
        if setting != "auto":
            self.phase, self.find_unused = "user", bool(setting)
            self.decision = Decision("find_unused_parameters", self.find_unused, "set by the user")
        elif static_graph:
            self.phase, self.find_unused = "user", False
            self.decision = Decision(
                "find_unused_parameters", False, "static_graph=True: DDP tracks a fixed set of unused parameters itself"
            )
        else:
            self.phase, self.find_unused = "window", False
            self.decision = Decision(
                "find_unused_parameters", "auto",
                f"deciding from the first {window} steps (fast path with a safety net meanwhile)",
            )
        self.initial = self.find_unused
        self._named: list[tuple[str, Parameter]] = []  # trainable parameters; "our" index space
        self._index: dict[int, int] = {}  # id(param) -> our index
        self._ddp_id: int | None = None
        self._to_ours: list[int] = []  # reducer index -> our index, for the current DDP wrapper
        self._ignored: list[int] = []
        self._user_ignore: list[str] | None = None
        self._steps = 0
        self._group = None
        self._never: torch.Tensor | None = None  # window: unused on every rank at every step so far
        self._touched: torch.Tensor | None = None  # window: needed the safety net on some rank at some step
        self._events: torch.Tensor | None = None  # fast path: safety-net events since the last check
        self._pending: tuple[Any, torch.Tensor] | None = None  # the event check in flight
        self._shared: torch.Tensor | None = None  # a finished check that found events: switch at the boundary
        self._period = check_every  # steps between event checks; the schedule is the same on every rank
        self._next_check = 0
        self._wants_rewrap = False

    # ----------------------------------------------------------------------------------------- hooks
    def after_backward(self, ddp: Module, group: Any = None) -> None:
        """After every backward, before the optimizer step. ``group``: a CPU-capable (gloo) group for the
        small evidence all-reduces, so they never synchronise with a GPU stream; ``None``: the world."""
        if self.phase in ("user", "dynamic") or not isinstance(ddp, DistributedDataParallel):
            return
        if not ddp.require_backward_grad_sync:  # inside no_sync (accumulation): the reducer is not involved
            return
        self._bind(ddp, group)
        missing, unused = self._finish_reduction(ddp)
        dropped = [i for i in self._ignored if self._named[i][1].grad is not None]
        for i in dropped:  # excluded from the all-reduce, so applying it would split the ranks
            self._named[i][1].grad = None
        self._steps += 1
        if self.phase == "window":
            self._window_step(missing, unused)
        else:
            if missing or dropped:
                self._events[missing + dropped] += 1
            if self._steps >= self._next_check:
                # The check launched a period ago is done (every step since synchronised the ranks); its
                # result is the same on every rank, so they all switch at the same boundary.
                shared = self._wait_pending()
                if shared is not None and shared.any():
                    self._shared = shared
                    return
                if shared is not None and self.phase == "fast":
                    self._period = min(2 * self._period, 16 * self.check_every)
                self._next_check = self._steps + self._period
                events = self._events.clone()
                self._events.zero_()
                self._pending = (dist.all_reduce(events, group=self._group, async_op=True), events)

    def at_boundary(self, ddp: Module) -> bool:
        """At a batch boundary (after an optimizer step). True: the caller must re-wrap now, on every rank,
        with :meth:`unwrap` and ``find_unused_parameters=self.find_unused``."""
        if self.phase == "window" and self._steps >= self.window:
            self._decide()
        elif self._shared is not None:
            self._switch_to_dynamic(self._shared)
            self._shared = None
        wants, self._wants_rewrap = self._wants_rewrap, False
        return wants and isinstance(ddp, DistributedDataParallel)

    def unwrap(self, ddp: DistributedDataParallel, keep_grads: bool = False) -> Module:
        """Detach ``ddp`` from its module and mark the parameters to exclude; returns the bare module.

        Gradients alias the old wrapper's buckets (``gradient_as_bucket_view``). After an optimizer step they
        are spent and are reset, which frees those buckets; ``keep_grads`` copies them out instead (manual
        optimization may accumulate across batches)."""
        module = ddp.module
        ddp._remove_autograd_hooks()
        for _, param in self._named:
            param.grad = param.grad.detach().clone() if keep_grads and param.grad is not None else None
        if self._user_ignore is None:
            self._user_ignore = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
        for _, param in self._named:
            if hasattr(param, "_ddp_ignored"):
                del param._ddp_ignored
        names = [self._named[i][0] for i in self._ignored]
        # "." + name as well: DDP's reducer spells root-level parameters that way.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, self._user_ignore + names + ["." + n for n in names if "." not in n]
        )
        self._ddp_id = None
        return module

    def finish(self, ddp: Module) -> None:
        """At the end of fit, on every rank: decide an unfinished window, report late safety-net events, and
        give the module back its own DDP ignore list (a later fit starts from evidence again)."""
        if not self._named:
            return
        module = getattr(ddp, "module", ddp)
        if self._user_ignore is not None:
            module._ddp_params_and_buffers_to_ignore = self._user_ignore
            for _, param in self._named:
                if hasattr(param, "_ddp_ignored"):
                    del param._ddp_ignored
        if self.phase == "window":
            self._decide()
            if self._wants_rewrap:  # too late to act on it
                self._wants_rewrap, self.phase, self.find_unused = False, "window", self.initial
                self.decision = Decision(
                    "find_unused_parameters", self.initial,
                    f"fit ended after {self._steps} steps, before acting on the evidence: {self.decision.reason}",
                )
        elif self.phase in ("fast", "static"):
            dist.all_reduce(self._events, group=self._group)
            events = self._events
            for shared in (self._wait_pending(), self._shared):
                events = events if shared is None else events + shared
            if events.any():
                self._switch_to_dynamic(events, switched=False)

    # ------------------------------------------------------------------------------------- internals
    def _bind(self, ddp: DistributedDataParallel, group: Any) -> None:
        if not self._named:
            self._named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
            self._index = {id(p): i for i, (_, p) in enumerate(self._named)}
            self._world = dist.get_world_size()
            self._group = group
            # CPU tensors on a gloo group; the world's own device otherwise (e.g. NCCL without gloo).
            backend = dist.get_backend(group)
            self._device = torch.device("cpu") if backend == "gloo" else ddp.device
            self._events = torch.zeros(len(self._named), dtype=torch.int32, device=self._device)
        if self._ddp_id != id(ddp):
            self._ddp_id = id(ddp)
            self._to_ours = [self._index[id(p)] for p in _reducer_parameters(ddp)]

    def _finish_reduction(self, ddp: DistributedDataParallel) -> tuple[list[int], list[int]]:
        """Complete a reduction DDP left unfinished. Returns (our indices that got no gradient in this
        backward, of which those without any gradient since the last zero_grad: unused in this step)."""
        try:
            ddp.reducer._check_reducer_finalized()
            return [], []
        except RuntimeError as error:
            params = _reducer_parameters(ddp)
            found = _MISSING_INDICES.search(str(error))
            if found:
                idx = [int(i) for i in re.split(r"[ ,]+", found.group(1).strip()) if i]
            else:  # message changed: with zero_grad(set_to_none=True), no gradient means None
                idx = [i for i, p in enumerate(params) if p.grad is None]
            if not idx or max(idx) >= len(params):
                raise
            missing = [params[i] for i in idx]
            unused = [self._to_ours[i] for i in idx if params[i].grad is None]
            # Zero gradients fire DDP's per-parameter hooks: the pending buckets all-reduce in order and the
            # reduction finishes, as with find_unused_parameters=True for a locally unused parameter.
            torch.autograd.backward(missing, [torch.zeros_like(p) for p in missing])
            ddp.reducer._check_reducer_finalized()
            return [self._to_ours[i] for i in idx], unused

    def _window_step(self, missing: list[int], unused: list[int]) -> None:
        n = len(self._named)
        flags = torch.zeros(2 * n, dtype=torch.int32, device=self._device)
        flags[missing] = 1
        flags[[n + i for i in unused]] = 1
        dist.all_reduce(flags, group=self._group)
        flags = flags.cpu()
        everywhere_unused = flags[n:] == self._world
        for i in everywhere_unused.nonzero().flatten().tolist():
            self._named[i][1].grad = None  # no rank used it: leave it alone, like find_unused_parameters=True
        touched = flags[:n] > 0
        self._never = everywhere_unused if self._never is None else self._never & everywhere_unused
        self._touched = touched if self._touched is None else self._touched | touched

    def _decide(self) -> None:
        never = self._never.nonzero().flatten().tolist()
        varying = (self._touched & ~self._never).nonzero().flatten().tolist()
        self.unused_names = [self._named[i][0] for i in never]
        self.varying_names = [self._named[i][0] for i in varying]
        self.unused_bytes = sum(self._named[i][1].numel() * self._named[i][1].element_size() for i in never)
        steps = f"the first {self._steps} steps"
        if not never and not varying:
            self.phase = "fast"
            self.decision = Decision(
                "find_unused_parameters", False,
                f"every parameter got a gradient on every rank in {steps}: DDP's fast path (a per-step check "
                "stands by in case that changes)",
            )
            return
        if not varying and len(never) < len(self._named):
            self.phase, self._ignored, self._wants_rewrap = "static", never, True
            self.decision = Decision(
                "find_unused_parameters", False,
                f"{len(never)} parameters ({self.unused_bytes / 2**20:.2f} MiB) got no gradient on any rank in "
                f"{steps}: excluded from synchronisation, fast path for the rest",
            )
            rank_zero_warn(
                f"SoloDDP: these parameters received no gradient in {steps} and are excluded from DDP's "
                f"synchronisation (freeze or remove them to save the memory): {', '.join(self.unused_names)}"
            )
            return
        self.phase, self.find_unused, self._wants_rewrap = "dynamic", True, True
        self.decision = Decision(
            "find_unused_parameters", True,
            f"{len(varying)} parameters got no gradient on some steps or ranks only in {steps}: DDP searches "
            "the graph for unused parameters every step",
        )
        never_part = f"; never: {', '.join(self.unused_names)}" if never else ""
        rank_zero_warn(
            "SoloDDP: find_unused_parameters=True, because these parameters received no gradient on some steps "
            f"or ranks only: {', '.join(self.varying_names)}{never_part}"
        )

    def _switch_to_dynamic(self, events: torch.Tensor, switched: bool = True) -> None:
        hit = events.cpu().nonzero().flatten().tolist()
        names = [self._named[i][0] for i in hit]
        dropped = [self._named[i][0] for i in hit if i in self._ignored]
        self.varying_names = sorted(set(self.varying_names) | set(names))
        what = "switched to find_unused_parameters=True" if switched else "the fit ended before switching to True"
        detail = f"; gradients of excluded parameters discarded on every rank: {', '.join(dropped)}" if dropped else ""
        self.decision = Decision(
            "find_unused_parameters", switched,
            f"after the first {self.window} steps, {len(names)} parameters changed between getting a gradient and "
            f"not (the safety net kept the ranks in step); {what} at step {self._steps}{detail}",
        )
        rank_zero_warn(
            f"SoloDDP: after the first {self.window} steps these parameters changed between getting a gradient "
            f"and not; {what} at step {self._steps}: {', '.join(names)}{detail}"
        )
        if switched:
            self.phase, self.find_unused, self._wants_rewrap, self._ignored = "dynamic", True, True, []

    def _wait_pending(self) -> torch.Tensor | None:
        if self._pending is None:
            return None
        work, events = self._pending
        self._pending = None
        work.wait()
        return events
