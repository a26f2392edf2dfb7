"""SoloDDP's unused-parameter hooks: where ``find_unused_parameters="auto"`` meets Lightning's loop.

The policy itself is :class:`lightning_solo.ddp.unused.policy.UnusedParameters`; these hooks give it DDP at wrap time,
the steps right around backward, the batch boundaries (re-wrap when it or the trainable set says so), a side
channel for collectives inside backward, and DDP's errors to explain.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.core.decision import Decision
from lightning_solo.ddp._base import SoloStrategyBase
from lightning_solo.ddp.advice import explain_reducer_error
from lightning_solo.ddp.unused.fast_path import all_gather_grad_on
from lightning_solo.ddp.unused.policy import Phase
from lightning_solo.ddp.unused.watch import search_safe_checkpointing, watch_collectives


class UnusedParameterHooks(SoloStrategyBase):
    """The unused-parameter hooks of :class:`~lightning_solo.ddp.strategy.SoloDDP` (not used on its own)."""

    _side_group: Any = None
    _side_channel_made: bool = False

    def _side_channel(self) -> Any:
        """A gloo group apart from DDP's, for the collectives "auto" issues while DDP may still hold buckets
        back (the fast path's usage map, a gradient-carrying all_gather's backward): gloo matches collectives
        per group. ``None`` when gloo cannot be had; "auto" then stays on True. Call on every rank alike."""
        if not self._side_channel_made:
            self._side_channel_made = True
            if self._barrier_group is torch.distributed.group.WORLD:  # the world runs gloo (on CPU tensors)
                self._side_group = torch.distributed.new_group(backend="gloo", timeout=self._timeout)
            else:  # the gloo side group of an nccl job, or None where gloo could not be had in time
                self._side_group = self._barrier_group
        return self._side_group

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        exact_allreduce = self._comm.name is None and self._ddp_comm_hook is None
        return self._unused.wrap(model, super()._setup_model, self._side_channel(), probe=exact_allreduce)

    def _rewrap(self) -> None:
        self._ddp_kwargs["find_unused_parameters"] = self._unused.find_unused
        # Not Lightning's _setup_model: it builds DDP on a side stream that does not wait for the optimizer
        # step still running on the current one, and DDP's initial broadcast would then send rank 0's half-
        # updated parameters. The replicas are in step already (post-local-SGD: deliberately not, between
        # averages), so no broadcast at all.
        kwargs = {**self._ddp_kwargs, "init_sync": False}
        device_ids = self.determine_ddp_device_ids()
        self.model = self._unused.rewrap(
            self.model,  # type: ignore[arg-type]  # DDP since setup
            lambda module: DistributedDataParallel(module, device_ids=device_ids, **kwargs),
            self._side_channel(),
            keep_grads=not self.module.automatic_optimization,
            exact_allreduce=self._comm.name is None and self._ddp_comm_hook is None,
        )
        self._register_ddp_hooks()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._unused.searching:
            return super().training_step(*args, **kwargs)
        # "auto" has DDP searching for unused parameters: what the search cannot follow is handled here
        # (lightning_solo.ddp.unused.watch).
        with search_safe_checkpointing(self._note_reentrant):
            return super().training_step(*args, **kwargs)

    def _note_reentrant(self) -> None:
        if "reentrant_checkpoint" not in self.decisions:
            self._decide(
                Decision(
                    "reentrant_checkpoint",
                    "non-reentrant while DDP searches",
                    "reentrant activation checkpointing fails DDP's unused-parameter search ('marked as ready "
                    "twice'); while find_unused_parameters='auto' searches, those calls run torch's non-reentrant "
                    "checkpointing (same values and gradients); find_unused_parameters=False: as stock",
                )
            )

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Strategy.backward, with the unused-parameter step right after backward and before on_after_backward:
        # a collective there (self.log(..., sync_dist=True), say) must not meet a bucket DDP still holds back.
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.module)
        self._unused.before_backward(self.wrapped)
        if self._unused.phase is Phase.WINDOW:  # evidence: does anything communicate inside backward?
            with watch_collectives(self._unused.note_backward_collective):
                self.precision_plugin.backward(closure_loss, self.module, optimizer, *args, **kwargs)
        else:
            self.precision_plugin.backward(closure_loss, self.module, optimizer, *args, **kwargs)
        self._unused.after_backward(self.wrapped)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        if sync_grads and torch.is_grad_enabled() and torch.distributed.is_initialized():
            # Its backward is a collective inside backward: "auto" leaves the fast path at the next boundary,
            # and until then that collective runs on the side channel, apart from DDP's buckets.
            self._unused.note_backward_collective("all_gather(sync_grads=True)")
            if self._unused.phase in (Phase.FAST, Phase.EXCLUDING):  # only with a side channel
                return all_gather_grad_on(tensor, group, self._side_channel())
        return super().all_gather(tensor, group, sync_grads)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # A batch boundary: the policy's decision is the same on every rank (it is made from all-reduced
        # evidence and the trainable set, which every rank changes alike), so every rank re-wraps together.
        rewrap = self._unused.at_boundary(self.wrapped)
        if self._comm.at_boundary(self.root_device) or rewrap:  # comm_hook="auto" between its trials too
            self._rewrap()
        if self.decisions.get("find_unused_parameters") is not self._unused.decision:
            self._decide(self._unused.decision)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning's rewrite of DDP's unused-parameter error points at its own strategy names.
        if self._unused.phase is Phase.USER:
            lightning_compat.augment_message(
                exception,
                pattern=".*(Expected to have finished reduction in the prior iteration|not used in producing the loss).*",
                new_message=(
                    "Some parameters of your LightningModule were not used in producing the loss. "
                    f"SoloDDP was given find_unused_parameters={self._unused.setting!r}; leave it at 'auto' (the "
                    "default) to detect and handle them, or set True."
                ),
            )
        else:
            self._unused.stop()
            explain_reducer_error(exception, self._unused)
