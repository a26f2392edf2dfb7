"""DDP gradient communication hooks chosen by name, registered on every device, with state carried by checkpoints.
See docs/comm-hooks.md."""

# No `from __future__ import annotations`: DDP inspects hook annotations at registration.
import contextlib
import socket
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo._compat import torch as torch_compat
from lightning_solo.checkpoint import rank_shards
from lightning_solo.core.checks import check_choice, check_int
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.comm import powersgd_state
from lightning_solo.ddp.comm.averaging import InPlaceAverager, average_in_place, node_groups
from lightning_solo.ddp.comm.barrier import backend_for

COMM_HOOKS = (None, "fp16", "bf16", "powersgd", "post_local_sgd")
CHECKPOINT_KEY = "lightning_solo.comm_hook"


def bf16_compress_any_build_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook`` under another name, which DDP refuses on CPU-only torch builds."""
    return torch_compat.compress_hook(torch.bfloat16, process_group, bucket)


_CPU_ONLY = torch.version.cuda is None and torch.version.hip is None
_BF16_HOOK = bf16_compress_any_build_hook if _CPU_ONLY else default.bf16_compress_hook


class CommHook:
    """A DDP gradient communication hook chosen by name, registered on any device, with checkpointable state.

    Args:
        name: ``None`` (exact all-reduce), ``"fp16"``/``"bf16"``, ``"powersgd"`` or ``"post_local_sgd"``.
        powersgd_rank, powersgd_start_iter: PowerSGD's approximation rank; exact steps before it compresses (>= 2).
        local_sgd_period, local_sgd_warmup: post-local-SGD's steps between averages; synchronous steps first.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 1000,
        local_sgd_period: int = 4,
        local_sgd_warmup: int = 100,
    ) -> None:
        hint = " or 'auto' (measure and keep the fastest); batched PowerSGD is not offered: broken in current torch"
        check_choice("comm_hook", name, COMM_HOOKS, hint)
        self.name = name
        self.powersgd_rank = check_int("powersgd_rank", powersgd_rank)
        # torch requires > 1 with error feedback/warm start: DDP re-buckets after its first iteration.
        self.powersgd_start_iter = check_int("powersgd_start_iter", powersgd_start_iter, minimum=2)
        self.local_sgd_period = check_int("local_sgd_period", local_sgd_period)
        self.local_sgd_warmup = check_int("local_sgd_warmup", local_sgd_warmup, minimum=0)
        self.state: Any = None
        self.hook: Any = None
        self.averager: Any = None
        self._trained_locally: dict[int, torch.Tensor] = {}  # id -> parameter, every one a local step updated
        self._replica: dict[str, Any] | None = None  # this rank's, read from a post-local-SGD checkpoint
        self._saved: dict[str, Any] = {}
        self._saved_path: Any = None
        self.own_replica = False  # each rank resumed its own model: the next DDP wrapper broadcasts nothing

    @property
    def local_step(self) -> bool:
        """Post-local-SGD after its warm-up on one node: the step runs outside DDP's reducer (docs/comm-hooks.md)."""
        state = self.state
        return (
            self.name == "post_local_sgd"
            and state is not None
            and not state.post_local_gradient_allreduce
            and state.iter >= state.start_localSGD_iter
        )

    def register_on(self, strategy: Any) -> Decision:
        """Register on ``strategy``'s DDP wrapper (or Lightning's ``ddp_comm_hook=``, given instead)."""
        if self.name is None and strategy._ddp_comm_hook is not None:
            lightning_compat.register_ddp_comm_hook(
                strategy.model, strategy._ddp_comm_state, strategy._ddp_comm_hook, strategy._ddp_comm_wrapper
            )
            name = getattr(strategy._ddp_comm_hook, "__qualname__", repr(strategy._ddp_comm_hook))
            return Decision("comm_hook", name, "ddp_comm_hook given by the user")
        decision = self.register(strategy.model, node=strategy.node_rank)
        if self.name == "post_local_sgd":
            strategy._ddp_comm_state, strategy._model_averaging_period = self.state, self.local_sgd_period
        return decision

    def register(self, ddp: DistributedDataParallel, *, node: Any = None) -> Decision:
        """Register the hook on ``ddp``, keeping its state across wrappers. ``node``: this rank's (default: hostname)."""
        if self.name is None:
            return Decision("comm_hook", None, "exact all-reduce in the gradients' dtype (DDP's default)")
        if self.name in ("fp16", "bf16"):
            self.hook = default.fp16_compress_hook if self.name == "fp16" else _BF16_HOOK
            lightning_compat.register_ddp_comm_hook(ddp, ddp_comm_hook=self.hook)
            error = "~1e-3" if self.name == "fp16" else "~1e-2"
            return Decision(
                "comm_hook", self.name, f"gradients all-reduced in {self.name}: half the bytes, {error} relative error"
            )
        if self.name == "powersgd":
            return self._register_powersgd(ddp)
        return self._register_post_local_sgd(ddp, socket.gethostname() if node is None else node)

    def _register_powersgd(self, ddp: DistributedDataParallel) -> Decision:
        if self.state is None:
            self.state = powersgd_state.new_state(self.powersgd_rank, self.powersgd_start_iter)
        else:  # a re-wrap: bring the state into per-parameter form for the new buckets
            powersgd_state.to_pending(self.state)
        powersgd_state.follow(self.state, ddp.module)
        # Only NCCL on CUDA tensors runs the hook's chained collectives in issue order (see the hook).
        self.state.serial = backend_for(dist.get_backend(ddp.process_group), ddp.device_type) != "nccl"
        self.hook = powersgd_state.resumable_powerSGD_hook
        self._apply_saved()
        lightning_compat.register_ddp_comm_hook(ddp, ddp_comm_state=self.state, ddp_comm_hook=self.hook)
        reason = (
            f"PowerSGD rank {self.powersgd_rank} with error feedback after {self.powersgd_start_iter} exact steps "
            "(torch's powerSGD_hook; its batched variant is broken in current torch)"
        )
        serial = "; on gloo each bucket finishes before the next, to keep collectives in order"
        return Decision("comm_hook", "powersgd", reason + (serial if self.state.serial else ""))

    def _register_post_local_sgd(self, ddp: DistributedDataParallel, node: Any) -> Decision:
        world = dist.get_world_size()
        if self.state is None:
            nodes: list[Any] = [None] * world
            dist.all_gather_object(nodes, node)
            groups = node_groups(nodes)
            if 1 < len(groups) < world:
                # Ranks of a node need not be contiguous (SLURM's cyclic distribution): group by the real node.
                subgroup, _ = dist.new_subgroups_by_enumeration(groups)
                sizes = "/".join(map(str, sorted({len(g) for g in groups})))
                self._between = f"gradients all-reduced within each of {len(groups)} nodes ({sizes} ranks)"
            else:  # one node (or one process per node): nothing cheaper to all-reduce over than the world
                subgroup, self._between = None, "no gradient communication"
            self.state = post_local.PostLocalSGDState(
                process_group=None,
                subgroup=subgroup,
                start_localSGD_iter=self.local_sgd_warmup,
                post_local_gradient_allreduce=subgroup is not None,
            )
        self.hook = post_local.post_localSGD_hook
        self._apply_saved()
        lightning_compat.register_ddp_comm_hook(ddp, ddp_comm_state=self.state, ddp_comm_hook=self.hook)
        return Decision(
            "comm_hook",
            "post_local_sgd",
            f"{self.local_sgd_warmup} synchronous steps, then {self._between} between steps and parameters "
            f"averaged over all {world} ranks every {self.local_sgd_period} steps",
        )

    def step_hooks(self) -> dict[str, Callable[..., Any]]:
        """The step moments it takes part in: post-local-SGD's only."""
        if self.name != "post_local_sgd":
            return {}
        return {"step": self._around_local_step, "after_step": self._after_local_step}

    @contextlib.contextmanager
    def _around_local_step(self, strategy: Any) -> Iterator[None]:
        if self.local_step and isinstance(strategy.model, DistributedDataParallel):
            # As no_sync does; only ever set False: Lightning's accumulation restores the flag it found.
            strategy.model.require_backward_grad_sync = False
        yield

    def _after_local_step(self, strategy: Any, optimizer: torch.optim.Optimizer) -> None:
        if self.averager is not None:  # Lightning's averager replaced (SoloDDP._enable_model_averaging)
            self.average_after_step(optimizer)
        if self.local_step and isinstance(strategy.model, DistributedDataParallel):
            # The next forward broadcasts rank 0's buffers, as after a synchronised step.
            strategy.model.require_forward_param_sync = True

    def attach_averager(self, averager: PeriodicModelAverager) -> PeriodicModelAverager:
        """Post-local-SGD: Lightning's averager replaced by one on the same schedule averaging in place."""
        self.averager = InPlaceAverager(averager.period, averager.warmup_steps, averager.process_group)
        self._apply_saved()
        return self.averager

    def average_after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Post-local-SGD, after every optimizer step, on every rank: average every trainable parameter of
        ``optimizer`` on the averager's schedule."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if self.local_step:
            self._trained_locally.update((id(p), p) for p in params)
        self.averager.average_parameters(params)

    def at_train_end(self, module: torch.nn.Module) -> None:
        """Post-local-SGD (a collective): the fit ends on the ranks' average of the parameters local steps trained."""
        if self.averager is not None:
            average_in_place([p for p in module.parameters() if p.requires_grad or id(p) in self._trained_locally])

    def state_dict(self, checkpoint_path: Any = None, replica: dict[str, Any] | None = None) -> dict[str, Any]:
        """The hook's state for a checkpoint (a collective for PowerSGD, and with a post-local-SGD ``replica``);
        per-rank state into shards beside ``checkpoint_path`` (docs/comm-hooks.md)."""
        if self.state is None:
            return {}
        if self.name == "post_local_sgd":
            step = self.averager.step if self.averager is not None else None
            saved = {"hook": self.name, "iter": self.state.iter, "averager_step": step}
            if self.local_step and checkpoint_path is not None:
                if replica is not None:
                    saved["replicas"] = rank_shards.write(checkpoint_path, "local_sgd", replica)
                else:  # a save that cannot wait for the other ranks (an exception)
                    warnings.warn(
                        f"{checkpoint_path}: saved between post-local-SGD averages without the other ranks, so it "
                        "holds rank 0's replica only; a resume from it starts every rank from that one",
                        stacklevel=2,
                    )
            return saved
        return powersgd_state.state_dict(self.state, checkpoint_path)

    def add_to_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, collective: bool) -> None:
        """The hook's state into a full ``checkpoint``; ``collective=False`` (a save on an exception): what needs no
        other rank."""
        if "optimizer_states" not in checkpoint or not (collective or self.name != "powersgd"):
            return
        replica = {key: checkpoint[key] for key in ("state_dict", "optimizer_states")} if collective else None
        if hook_state := self.state_dict(filepath, replica):
            checkpoint[CHECKPOINT_KEY] = hook_state

    def on_load_checkpoint(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """The hook's state from ``checkpoint``, and this rank's post-local-SGD replica (if saved) put in place."""
        self.load_state_dict(checkpoint.get(CHECKPOINT_KEY), checkpoint_path)
        if self._replica is not None:
            checkpoint.update(self._replica)
            self._replica, self.own_replica = None, True

    def load_state_dict(self, saved: dict[str, Any] | None, checkpoint_path: Any = None) -> None:
        """Take back :meth:`state_dict`'s result on every rank; applied now or at :meth:`register`."""
        saved = {key: value for key, value in (saved or {}).items() if key != "auto"}
        if not saved:
            return
        if saved.get("hook") != self.name:
            warnings.warn(
                f"the checkpoint holds state for comm_hook={saved.get('hook')!r}, this run uses {self.name!r}: ignored",
                stacklevel=2,
            )
            return
        self._saved, self._saved_path = dict(saved), checkpoint_path
        if dist.is_available() and dist.is_initialized():
            self._saved = self._this_rank(self._saved, checkpoint_path)
        if self.state is not None:
            self._apply_saved()

    def _this_rank(self, saved: dict[str, Any], checkpoint_path: Any) -> dict[str, Any]:
        """``saved`` with this rank's error feedback or replica, read from its shard."""
        if saved.pop("_resolved", False):
            return saved
        world, rank = dist.get_world_size(), dist.get_rank()
        if "replicas" in saved:  # post-local-SGD between averages
            if len(saved["replicas"]["sha256"]) == world:
                what = "post-local-SGD replica (model and optimizer state)"
                self._replica = rank_shards.read(checkpoint_path, saved["replicas"], rank, what, mmap=False)
            else:
                warnings.warn(
                    f"post-local-SGD replicas were saved with {len(saved['replicas']['sha256'])} ranks and this run "
                    f"has {world}: every rank resumes from rank 0's",
                    stacklevel=3,
                )
        elif saved.get("world_size", world) != world:
            warnings.warn(
                f"PowerSGD error feedback was saved with {saved['world_size']} ranks and this run has {world}: it "
                "restarts from zero",
                stacklevel=3,
            )
            saved["error"] = None
        elif "shards" in saved:
            saved["error"] = rank_shards.read(checkpoint_path, saved["shards"], rank, "PowerSGD error feedback")
        elif isinstance(saved.get("error"), list):  # every rank's, gathered (a notebook's next fit, older files)
            saved["error"] = saved["error"][rank]
        return {**saved, "_resolved": True}

    def _apply_saved(self) -> None:
        saved, state = self._saved, self.state
        if not saved or state is None:
            return
        if self.name == "post_local_sgd":
            state.iter = saved["iter"]
            if self.averager is not None and saved.get("averager_step") is not None:
                self.averager.step = saved["averager_step"]
                self._saved = {}
            return
        powersgd_state.apply_saved(state, self._this_rank(saved, self._saved_path))
        self._saved = {}
