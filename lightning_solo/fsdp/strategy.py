"""SoloFSDP: fully sharded data parallel (torch's FSDP2, ``fully_shard``) over every device of every node, applied
by the strategy with sound defaults, on GPUs and on CPU (gloo); each choice a Decision. See docs/multi-node.md.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo._compat import torch as torch_compat
from lightning_solo.checkpoint.io import SoloCheckpointIO
from lightning_solo.checkpoint.manifest import read_manifest, verify
from lightning_solo.checkpoint.sharded import save_sharded, verify_sharded
from lightning_solo.core.checks import check_bool, check_int, check_number
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.ddp.precision.rule import capabilities, device_capability

Precision = Literal["auto", "bf16-mixed", "32-true"]


def decide_fsdp_precision(
    precision: str, device: torch.device, levels: list[int] | None = None
) -> tuple[Any, Decision]:
    """FSDP2's ``MixedPrecisionPolicy`` (``None``: fp32) for ``precision``; ``"auto"``: bf16 where every rank's GPU
    has it natively (``levels``: every rank's ``device_capability``), fp32 elsewhere. The output stays fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in ("auto", "bf16-mixed", "32-true"):
        raise ValueError(f"precision must be 'auto', 'bf16-mixed' or '32-true', got {precision!r}")
    if precision == "auto" and device.type == "cuda" and levels is None:
        levels = [device_capability(device)]
    bf16 = precision == "bf16-mixed" or (precision == "auto" and device.type == "cuda" and min(levels or [0]) == 2)
    if not bf16:
        why = "asked for" if precision == "32-true" else f"auto: no native bf16 on every rank's {device.type}"
        return None, Decision("fsdp_precision", "32-true", why)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    why = "bf16 parameters and compute, gradients reduced in fp32"
    return policy, Decision("fsdp_precision", "bf16-mixed", why if precision != "auto" else f"auto: {why}")


def group_policy_for(policy: Any, top_level: bool) -> Any:
    """``policy`` for a shard group: output cast to fp32 in a top-level group only (nested ones hand bf16 on)."""
    if policy is None or top_level:
        return policy
    return dataclasses.replace(policy, output_dtype=None)


def decide_bn_precision(policy: Any, layers: int) -> tuple[Any, Decision]:
    """FSDP2's policy for BatchNorm layers with parameters under a bf16 model: fp32 parameters, each layer its own
    shard group, the input as it comes (as under ``torch.autocast``). See docs/multi-node.md."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy is None or not layers:
        return None, Decision("fsdp_bn_precision", "as the model", "no BatchNorm layer" if layers else "fp32")
    bn_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    why = f"{layers} BatchNorm layer(s): fp32 parameters, each its own shard group, bf16 activations as under autocast"
    return bn_policy, Decision("fsdp_bn_precision", "32-true", why)


def decide_wrap(
    module: nn.Module, wrap_classes: list[str] | None, min_num_params: int
) -> tuple[list[nn.Module], Decision]:
    """The modules that get their own shard group, innermost first: those of ``wrap_classes``, else those holding
    ``min_num_params`` parameters not yet in a group; then the LightningModule's children with parameters."""
    chosen: list[nn.Module] = []

    def visit(m: nn.Module) -> int:  # parameters of m not yet in a chosen group
        free = sum(p.numel() for p in m.parameters(recurse=False))
        for child in m.children():
            free += visit(child)
        if m is not module and (type(m).__name__ in wrap_classes if wrap_classes else free >= min_num_params):
            chosen.append(m)
            return 0
        return free

    visit(module)
    if any(True for _ in module.parameters(recurse=False)):
        name = type(module).__name__
        raise ValueError(f"{name} holds parameters itself: keep them in a submodule, or shard it in configure_model()")
    roots = [c for c in module.children() if c not in chosen and any(True for _ in c.parameters())]
    rule = f"classes {wrap_classes}" if wrap_classes else f">= {min_num_params:,} parameters"
    why = f"{len(chosen)} module(s) by {rule}, then {len(roots)} top-level module(s)"
    return [*chosen, *roots], Decision("fsdp_wrap", len(chosen) + len(roots), why)


def decide_bn_stats(average: bool, layers: int, world_size: int) -> Decision:
    """Whether the BatchNorm running statistics are averaged over the ranks (FSDP broadcasts no buffers)."""
    if not average:
        return Decision("bn_stats", "per rank", "average_bn_stats=False: each rank keeps its own, as stock")
    if not layers or world_size == 1:
        return Decision("bn_stats", "per rank", "no BatchNorm layer" if not layers else "one rank")
    why = f"{layers} BatchNorm layer(s): statistics averaged over {world_size} ranks before evaluations and checkpoints"
    return Decision("bn_stats", "mean over ranks", why)


class SoloFSDP(DecisionLog, ModelParallelStrategy):
    """FSDP2 over all ranks; checkpoints through torch's distributed checkpoint, written atomically and verified.

    Args:
        precision: ``"auto"`` (bf16 on GPUs that have it, else fp32), ``"bf16-mixed"`` or ``"32-true"``.
        wrap_classes: class names that each get their own shard group; ``None``: by size, ``min_num_params``.
        min_num_params: the size rule's threshold.
        reshard_after_forward: free gathered parameters after forward (least memory); ``False``: after backward.
        state_dict: ``"sharded"``: a DCP directory per checkpoint; ``"full"``: one file gathered on rank 0.
        timeout: collective timeout, seconds or a ``timedelta``.
        average_bn_stats: average BatchNorm running statistics over the ranks (:func:`decide_bn_stats`).
    """

    strategy_name = "solo_fsdp"

    def __init__(
        self,
        *,
        precision: Precision = "auto",
        wrap_classes: list[str] | None = None,
        min_num_params: int = 1_000_000,
        reshard_after_forward: bool = True,
        state_dict: Literal["sharded", "full"] = "sharded",
        timeout: timedelta | float | int = timedelta(minutes=30),
        average_bn_stats: bool = True,
        process_group_backend: str | None = None,
        cluster_environment: Any = None,
    ) -> None:
        if state_dict not in ("sharded", "full"):
            raise ValueError(f"state_dict must be 'sharded' or 'full', got {state_dict!r}")
        decide_fsdp_precision(precision, torch.device("cpu"))  # checks the value now, not in the workers
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=check_number("timeout", timeout))
        super().__init__(
            save_distributed_checkpoint=state_dict == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.precision = precision
        self.wrap_classes = list(wrap_classes) if wrap_classes else None
        self.min_num_params = check_int("min_num_params", min_num_params)
        self.reshard_after_forward = check_bool("reshard_after_forward", reshard_after_forward)
        self.state_dict_type = state_dict
        self.average_bn_stats = check_bool("average_bn_stats", average_bn_stats)
        self._bn_layers: list[torch_compat.BatchNormBase] = []
        self.checkpoint_io = SoloCheckpointIO()
        self._dcp: tuple[Any, Any] | None = None  # async sharded saves: DCP's gloo group, the write in flight
        if cluster_environment is not None:
            self.cluster_environment = cluster_environment
        self.decisions: dict[str, Decision] = {}

    @override
    def _configure_launcher(self) -> None:
        # Always a launcher, as DDPStrategy: every rank splits the CPU threads alike (docs/multi-node.md).
        assert self.cluster_environment is not None
        self._launcher = lightning_compat.SubprocessScriptLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes
        )

    @override
    def setup_environment(self) -> None:
        # One data-parallel dimension over every rank of every node, no tensor parallelism.
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    @override
    def setup(self, trainer) -> None:
        from torch.distributed.fsdp import fully_shard

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if is_overridden("configure_model", self.lightning_module):
            self._decide(Decision("fsdp_wrap", "configure_model", "the LightningModule shards itself"))
        else:
            auto_gpu = self.precision == "auto" and self.root_device.type == "cuda"
            levels = capabilities(self.root_device) if auto_gpu else None  # agreed by every rank (a collective)
            policy, decision = decide_fsdp_precision(self.precision, self.root_device, levels)
            self._decide(decision)
            groups, decision = decide_wrap(self.model, self.wrap_classes, self.min_num_params)
            self._decide(decision)
            norms = [  # BatchNorm layers with parameters: leaves, so sharded before any group that holds them
                m
                for m in self.model.modules()
                if isinstance(m, torch_compat.BatchNormBase) and any(True for _ in m.parameters())
            ]
            bn_policy, decision = decide_bn_precision(policy, len(norms))
            self._decide(decision)
            if bn_policy is None:
                norms = []
            top = {id(c) for c in self.model.children()}
            mesh = self.device_mesh["data_parallel"]
            for group in [*norms, *(g for g in groups if g not in norms)]:
                norm = group in norms
                group_policy = bn_policy if norm else group_policy_for(policy, id(group) in top)
                kwargs = {"mp_policy": group_policy} if group_policy is not None else {}
                # A BatchNorm's few parameters stay gathered from forward to backward: one all-gather, not two.
                reshard = self.reshard_after_forward and not norm
                fully_shard(group, mesh=mesh, reshard_after_forward=reshard, **kwargs)
        # As ModelParallelStrategy.setup, less its demand for configure_model.
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        why = "torch distributed checkpoint, one shard per rank" if self.state_dict_type == "sharded" else "rank 0"
        self._decide(Decision("fsdp_state_dict", self.state_dict_type, why))
        layers = [
            m for m in self.model.modules() if isinstance(m, torch_compat.BatchNormBase) and m.running_mean is not None
        ]
        decision = self._decide(decide_bn_stats(self.average_bn_stats, len(layers), self.world_size))
        self._bn_layers = layers if decision.value == "mean over ranks" else []

    def _average_bn_stats(self) -> None:
        """One all-reduce of every BatchNorm layer's running mean and variance, divided by the world size."""
        if not self._bn_layers:
            return
        buffers = [b for m in self._bn_layers for b in (m.running_mean, m.running_var) if b is not None]
        flat = torch.cat([b.detach().flatten().float() for b in buffers])
        torch.distributed.all_reduce(flat)
        flat /= self.world_size
        for b, mean in zip(buffers, flat.split([b.numel() for b in buffers])):
            b.copy_(mean.view_as(b))

    @override
    def on_train_end(self) -> None:
        self._average_bn_stats()
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:
        self._average_bn_stats()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._average_bn_stats()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._average_bn_stats()
        super().on_predict_start()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._average_bn_stats()  # every rank collects the state dict: the checkpoint keeps the ranks' mean
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self.state_dict_type == "full":
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # rank 0, SoloCheckpointIO
        path = self.broadcast(os.fspath(filepath))
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        io = self.checkpoint_io if isinstance(self.checkpoint_io, SoloCheckpointIO) else None
        writer = io.background() if io is not None else None  # SoloCheckpoint(async_save=True), on every rank
        if writer is None:
            save_sharded(state, checkpoint, path, self.global_rank, self.barrier, io)
            return
        # DCP's collectives run on its thread: a group of their own, and one write in flight at a time.
        group, future = self._dcp or (torch.distributed.new_group(backend="gloo", timeout=self._timeout), None)
        if future is not None:
            future.result()
        saved = save_sharded(state, checkpoint, path, self.global_rank, self.barrier, io, group)
        assert saved is not None
        future, commit = saved
        self._dcp = (group, future)
        writer.add(commit, label=path)

    @override
    def teardown(self) -> None:
        if self._dcp is not None and self._dcp[1].done():  # else a write still uses it (a wait for it timed out)
            torch.distributed.destroy_process_group(self._dcp[0])
        self._dcp = None
        super().teardown()

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(os.fspath(checkpoint_path))
        if os.path.isdir(path):
            verify_sharded(path)
        elif read_manifest(path) is not None:
            verify(path)
        return super().load_checkpoint(path, weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            if os.path.isdir(filepath):
                shutil.rmtree(filepath)
            else:
                self.checkpoint_io.remove_checkpoint(filepath)

    def settings(self) -> dict[str, Any]:
        """The effective FSDP settings, for the run summary."""
        names = ("world_size", "num_nodes", "precision", "wrap_classes", "min_num_params", "reshard_after_forward")
        return {
            **{name: getattr(self, name) for name in names},
            "backend": self.process_group_backend,
            "state_dict": self.state_dict_type,
            "timeout_s": self._timeout.total_seconds() if self._timeout else None,
            "average_bn_stats": self.average_bn_stats,
        }
