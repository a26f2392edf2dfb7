"""SoloDDP: Lightning's DDPStrategy with defaults that are right for 1..N devices (docs/soloddp.md).

Wiring only: each Lightning hook is overridden once and calls the features in the order they run; the per-step
moments go through :mod:`lightning_solo.ddp.component`, so a feature that is off costs no call.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_solo._compat.patch import Patches
from lightning_solo.checkpoint.io import SoloCheckpointIO
from lightning_solo.core import cluster, cpu_malloc
from lightning_solo.core.checks import check_bool, check_number
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.ddp import comm, syncbn
from lightning_solo.ddp import precision as amp
from lightning_solo.ddp.advice import ddp_advice
from lightning_solo.ddp.compile import CompiledSteps, CompileSetting
from lightning_solo.ddp.compiled_keys import CompiledKeys
from lightning_solo.ddp.component import Listeners, StepHooks
from lightning_solo.ddp.eval import decide_exact_eval, mean_operand
from lightning_solo.ddp.launcher import SoloLauncher, StartMethod, decide_start_method
from lightning_solo.ddp.resume.session import ExactResume, load_auto_checkpoint
from lightning_solo.ddp.sigterm import SigtermSetting
from lightning_solo.ddp.uneven import Policy as UnevenPolicy
from lightning_solo.ddp.uneven import UnevenData
from lightning_solo.ddp.unused.fast_path import all_gather_grad_on
from lightning_solo.ddp.unused.messages import REENTRANT_CHECKPOINT, explain_exception
from lightning_solo.ddp.unused.policy import UnusedParameters
from lightning_solo.ddp.watchdog import Heartbeat, WatchdogSession
from lightning_solo.ddp.watchdog import heartbeat as hb


class SoloDDP(DecisionLog, DDPStrategy):
    """DDP with sound defaults (see docs/soloddp.md for every option). ``**ddp_kwargs`` go to
    :class:`torch.nn.parallel.DistributedDataParallel` (``bucket_cap_mb``, ``static_graph``, ...)."""

    strategy_name = "solo_ddp"
    _timeout: timedelta  # always one: __init__ makes it

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool | Literal["auto"] = "auto",
        rewrap_on_trainable_change: bool = True,
        start_method: StartMethod = "auto",
        timeout: timedelta | float | int = timedelta(minutes=30),
        process_group_backend: str | None = None,
        sync_batchnorm: bool | Literal["auto"] = "auto",
        sync_batchnorm_threshold: int = 32,
        precision: str | None = None,
        scaler: dict[str, float] | None = None,
        skip_lr_on_overflow: bool = False,
        comm_hook: str | None = None,
        powersgd_rank: int | None = None,
        powersgd_start_iter: int | None = None,
        local_sgd_period: int | None = None,
        local_sgd_warmup: int | None = None,
        gloo_side_group: bool = True,
        exact_eval: bool = True,
        exact_resume: bool = True,
        cpu_malloc_reuse: bool = True,
        sigterm_agreement: bool = True,
        sigterm_checkpoint: bool = True,
        uneven_data: UnevenPolicy = "shortest",
        watchdog: bool | Mapping[str, Any] = True,
        compile: CompileSetting = False,
        strip_compiled_prefix: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        launcher = decide_start_method(start_method)
        unused = UnusedParameters(find_unused_parameters, static_graph=bool(ddp_kwargs.get("static_graph")),
                                  follow_trainable=rewrap_on_trainable_change)  # fmt: skip
        comm_hooks = comm.make_comm_hook(
            comm_hook, ddp_kwargs, rewraps=unused.in_window, powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter, local_sgd_period=local_sgd_period,
            local_sgd_warmup=local_sgd_warmup,
        )  # fmt: skip
        precision_options = amp.precision_options(precision, scaler, skip_lr_on_overflow, precision_plugin)
        if not isinstance(timeout, timedelta):
            timeout = timedelta(
                seconds=check_number("timeout", timeout, what="a positive number of seconds or a timedelta")
            )
        super().__init__(
            accelerator, parallel_devices, cluster_environment, checkpoint_io or SoloCheckpointIO(),
            precision_plugin or amp.pending_plugin(precision_options),
            process_group_backend=process_group_backend, timeout=timeout, start_method=launcher.value,
            gradient_as_bucket_view=gradient_as_bucket_view, find_unused_parameters=unused.initial, **ddp_kwargs,
        )  # fmt: skip
        self.decisions: dict[str, Decision] = {}
        self.comm_hook = comm_hooks  # the gradient communication (``comm_hook=``)
        self.advice: list[str] = []  # the end-of-fit advice from DDP's logging data (ddp/advice.py)
        self._unused = unused
        self._resume = ExactResume(enabled=check_bool("exact_resume", exact_resume))
        self._compile = CompiledSteps(compile)
        self._compiled_keys = CompiledKeys(strip_compiled_prefix)
        self._sigterm = SigtermSetting(sigterm_agreement, sigterm_checkpoint)
        self._uneven = UnevenData(uneven_data)
        self._syncbn = syncbn.LayerSyncChoice(sync_batchnorm, sync_batchnorm_threshold)
        self.sync_batchnorm_threshold = self._syncbn.threshold  # below it per device, "auto" synchronises
        self._precision_options = precision_options
        self._exact_eval = bool(exact_eval)
        self._cpu_malloc_reuse = check_bool("cpu_malloc_reuse", cpu_malloc_reuse)
        self._watchdog = WatchdogSession(watchdog)
        self._groups = comm.SideGroups(gloo=gloo_side_group)  # made at the first setup
        self._hooks = StepHooks()
        self._patches = Patches()  # a run's patches of upstream objects, undone at its teardown
        self._rewrap_listeners = Listeners()
        self._keep(launcher, decide_exact_eval(self._exact_eval), unused.decision, unused.follow_decision,
                   self._watchdog.decision)  # fmt: skip
        self._keep(self._compile.decision, self._compiled_keys.decision(None))

    @property
    def side_group(self) -> Any:
        """A gloo group apart from DDP's; ``None`` before setup or without gloo."""
        return self._groups.side_group

    def add_rewrap_listener(self, listener: Callable[[DistributedDataParallel], Any]) -> None:
        """Call ``listener(old)`` before a re-wrap drops DDP wrapper ``old``; held weakly, for this fit."""
        self._rewrap_listeners.add(listener)

    def heartbeats(self) -> dict[int, Heartbeat]:
        """Each rank's latest heartbeat as this rank's watchdog read it; empty without one."""
        return self._watchdog.heartbeats()

    def settings(self) -> dict[str, Any]:
        """The effective DDP settings, for the run summary."""
        return {"world_size": self.world_size, "num_nodes": self.num_nodes, "backend": self.process_group_backend,
                "start_method": self._start_method, "timeout_s": self._timeout.total_seconds(), **self._ddp_kwargs}  # fmt: skip

    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            return super()._configure_launcher()
        self._launcher = SoloLauncher(self, start_method=self._start_method)  # the parent gets the fit's state back

    @override
    def setup_environment(self) -> None:
        backend = self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        self._keep(self._watchdog.prepare_environment(backend))
        super().setup_environment()  # the device, then the process group
        self._watchdog.restore_environment()  # torch read it making the group: it outlives no step of the fit
        self._keep(cluster.decide_external_launch(self.cluster_environment))
        # Every rank can take part now: the placeholder precision plugin settles ("auto" is agreed by all ranks).
        self.precision_plugin, decisions = amp.decide_precision_plugin(
            self.precision_plugin, self._precision_options, self._attached_trainer, self.root_device
        )
        self._keep(*decisions)
        if self.root_device.type == "cpu":
            self._decide(Decision("cpu_threads", torch.get_num_threads(), "cores split between local processes"))
            self._decide(cpu_malloc.decide(reuse=self._cpu_malloc_reuse))
        self._decide(Decision("process_group_backend", self.process_group_backend, "nccl on CUDA, gloo otherwise"))
        warn = self.num_nodes > 1 and self.local_rank == 0  # one rank per node warns
        self._keep(self._groups.setup(self._timeout, self.root_device, warn))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._patches = Patches()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._decide(self._syncbn.choose(self, trainer))  # the plugin DDPStrategy's setup converts with
            self._unused = self._unused.fresh()  # every fit decides from its own evidence
            self._decide(self._unused.decision)
            self._compile = self._compile.fresh()
            self._decide(self._compile.setup(trainer.lightning_module))  # compiled before DDP wraps it
        self._keep(self._compiled_keys.decision(trainer.lightning_module))
        super().setup(trainer)  # SyncBN converted and DDP built (fitting)
        # Every run, before its loaders are processed; every rank alike.
        group = self._side_channel() if self._uneven.policy and self.world_size > 1 else None
        self._decide(self._uneven.setup(self.world_size, group, self._patches))
        if fitting:  # before Lightning registers its signal handlers
            self._sigterm.install(trainer, self._side_channel, self._decide, self._patches)
            self._watchdog.start(trainer, self.global_rank, self.world_size, self._timeout)
        self._rebuild_hooks()

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # After a post-local-SGD resume each rank has its own replica: DDP broadcasts none over it.
        init_sync, self.comm_hook.own_replica = not self.comm_hook.own_replica, False
        build = functools.partial(self._build_ddp, init_sync=init_sync)
        return self._unused.wrap(model, build, self._side_channel(), probe=self._exact_allreduce)

    def _build_ddp(self, module: torch.nn.Module, *, init_sync: bool) -> DistributedDataParallel:
        """DDP around ``module``, with the policy's ``find_unused_parameters``: stock's build (Lightning's, rank 0's
        parameters broadcast), or with ``init_sync=False`` no broadcast, on the current stream."""
        self._ddp_kwargs["find_unused_parameters"] = self._unused.find_unused
        if init_sync:
            return super()._setup_model(module)
        kwargs = {**self._ddp_kwargs, "init_sync": False}
        return DistributedDataParallel(module, device_ids=self.determine_ddp_device_ids(), **kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        self._decide(self.comm_hook.register_on(self))

    @override
    def _enable_model_averaging(self) -> None:
        super()._enable_model_averaging()  # checks the optimizers, makes Lightning's PeriodicModelAverager
        # The comm hook averages instead, over every trainable parameter (docs/comm-hooks.md).
        self.comm_hook.attach_averager(self._model_averager)  # type: ignore[arg-type]
        self._model_averager = None

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self._attached_trainer
        if trainer is not None and trainer.training:  # resumable, the resume plan attached
            dataloader = self._resume.on_dataloader(dataloader, trainer, self._decide)
        dataloader = self._uneven.on_dataloader(dataloader, trainer)  # outside the resumable loader
        return self._sigterm.shield_workers(dataloader)

    @override
    def on_train_start(self) -> None:
        self._resume.close_loaders(self._module.trainer)  # before the epoch loop reads the counters it rewinds
        super().on_train_start()
        self._watchdog.data_wait(self._module.trainer.global_step)
        # Made after setup, while restoring a checkpoint (e.g. the GradScaler kept across a resume).
        self._keep(*getattr(self.precision_plugin, "decisions", {}).values())

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        trainer = self._attached_trainer
        if trainer is not None and trainer.training and not trainer.sanity_checking:
            for hook in self._hooks.by_moment["batch"]:
                hook(trainer)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # The policy and comm_hook="auto" decide alike on every rank, so every rank re-wraps together.
        rewrap = self._unused.at_boundary(self._wrapped)
        for hook in self._hooks.by_moment["boundary"]:
            rewrap |= hook(self)
        if rewrap:
            self._rewrap()
        if self.decisions.get("find_unused_parameters") is not self._unused.decision:
            self._decide(self._unused.decision)
        for hook in self._hooks.by_moment["batch_start"]:
            hook(self)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._unused.step_context(lambda: self._keep(REENTRANT_CHECKPOINT)), self._around("step", self):
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Strategy.backward with the policy's steps right around the plugin's backward, before on_after_backward:
        # a collective there (self.log(..., sync_dist=True)) must not meet a bucket DDP holds.
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self._module)
        self._unused.before_backward(self._wrapped)
        with self._unused.backward_context(), self._around("backward"):
            self.precision_plugin.backward(closure_loss, self._module, optimizer, *args, **kwargs)
        self._unused.after_backward(self._wrapped)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self._module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with self._around("optimizer_step"):  # the closure runs training_step
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        for hook in self._hooks.by_moment["after_step"]:
            hook(self, optimizer)
        return output

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        if sync_grads and torch.is_grad_enabled() and torch.distributed.is_initialized():
            # A collective inside backward: on the fast path it runs on the side channel, apart from DDP's buckets.
            self._unused.note_backward_collective("all_gather(sync_grads=True)")
            if self._unused.on_fast_path:
                return all_gather_grad_on(tensor, group, self._side_channel())
        with self._around("collective", "all_gather"):
            return super().all_gather(tensor, group, sync_grads)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if self._exact_eval:  # the integer sample counts behind sync_dist epoch means average in float
            tensor = mean_operand(tensor, reduce_op, caller=sys._getframe(1))
        with self._around("collective", "reduce"):
            return super().reduce(tensor, group, reduce_op)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._around("collective", "broadcast"):
            return super().broadcast(obj, src)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._watchdog.validation_start(sanity=self._module.trainer.sanity_checking)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._resume.after_validation(self._module.trainer)  # the training RNG as the last batch left it
        self._watchdog.validation_end()

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        # A monitored barrier names the ranks that never arrived instead of hanging until the timeout.
        with self._around("collective", f"barrier {name!r}" if name else "barrier"):
            if self._groups.barrier is None or not torch.distributed.is_initialized():
                return super().barrier(name, *args, **kwargs)
            comm.monitored_barrier(name, self._timeout, self._groups.barrier)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        with self._watchdog.phase(hb.CHECKPOINT_SAVE):
            self.add_resume_state(checkpoint, filepath=filepath)
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def add_resume_state(self, checkpoint: dict[str, Any], collective: bool = True, filepath: Any = None) -> None:
        """Put the resume record and the comm-hook state into ``checkpoint``; ``collective=False``: this rank's."""
        self._resume.add_to_checkpoint(checkpoint, self._attached_trainer, collective)
        self.comm_hook.add_to_checkpoint(checkpoint, filepath, collective)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._compiled_keys.save(super().lightning_module_state_dict(), self._module)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Before setup on fit(ckpt_path=...): either spelling of a compiled submodule's keys, in the module's own.
        self._keep(self._compiled_keys.decision(self._module))
        state_dict = self._compiled_keys.load(checkpoint["state_dict"], self._module)
        super().load_model_state_dict({**checkpoint, "state_dict": state_dict}, strict=strict)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if os.fspath(checkpoint_path) == "auto":  # rank 0 chooses, every rank checks it sees that file
            checkpoint, checkpoint_path = load_auto_checkpoint(self, weights_only)
            if checkpoint_path is None:
                return checkpoint  # none: a falsy checkpoint, the fit starts fresh
        else:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume.on_load_checkpoint(checkpoint)
        self.comm_hook.on_load_checkpoint(checkpoint, checkpoint_path)
        return checkpoint

    @override
    def on_train_end(self) -> None:
        # Not the end of the fit (a LearningRateFinder runs the fit loop and this hook first): see teardown.
        super().on_train_end()
        self.comm_hook.at_train_end(self._module)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Not DDPStrategy's rewrite of DDP's unused-parameter error: it names Lightning's strategies.
        self._watchdog.on_exception(exception)
        self._unused.stop()
        explain_exception(exception, self._unused)

    @override
    def teardown(self) -> None:
        state = getattr(self._attached_trainer, "state", None)
        if state is not None and (state.fn, state.status) == (TrainerFn.FITTING, TrainerStatus.RUNNING):
            # A completed fit (not INTERRUPTED), every rank here: the collectives in flight settle, results final.
            self._sigterm.close()
            self._watchdog.stop()  # "done" at once: no peer takes this rank's exit for a death
            self._unused.finish(self._wrapped)
            self._keep(self._unused.decision, self._compile.finish(), self._compile.fallback)
            if isinstance(self.model, DistributedDataParallel):
                self.advice = ddp_advice(self.model, self._unused)
                rank_zero_info("SoloDDP advice:\n" + "\n".join(f"  - {line}" for line in self.advice))
        self._rewrap_listeners.clear()
        self._hooks = StepHooks()
        self._watchdog.teardown()
        self._sigterm.teardown()
        self._resume.reset()
        self._compile.teardown()
        with self._syncbn.around_teardown(self):
            super().teardown()  # unwraps DDP, reverts SyncBN with the plugin setup chose
        self._patches.close()
        cpu_malloc.restore()

    def _side_channel(self) -> Any:
        return self._groups.side(self._timeout)

    def _rewrap(self) -> None:
        """Every rank at a batch boundary: the old wrapper read by the listeners and dropped (its buckets are as big
        as the gradients), then the next built with no broadcast (the replicas are in step) on the current stream."""
        old = cast(DistributedDataParallel, self.model)
        self._rewrap_listeners(old)
        self.model = module = self._unused.unwrap(old, keep_grads=not self._module.automatic_optimization)
        gone = weakref.ref(old)
        del old
        if gone() is not None:  # a reference cycle would keep it (and its buckets) until the next collection
            gc.collect()
        build = functools.partial(self._build_ddp, init_sync=False)
        self.model = self._unused.rebuild(module, build, self._side_channel(), exact_allreduce=self._exact_allreduce)
        self._register_ddp_hooks()
        self._rebuild_hooks()  # comm_hook="auto" takes no part once decided

    def _around(self, moment: str, *args: Any) -> contextlib.AbstractContextManager[Any]:
        """The contexts of the features taking part in ``moment``; none: no call into them."""
        return self._hooks.around(moment, *args) if self._hooks.by_moment[moment] else contextlib.nullcontext()

    def _rebuild_hooks(self) -> None:
        self._hooks.rebuild([self.comm_hook, self._watchdog, self._compile, self._resume])

    @property
    def _exact_allreduce(self) -> bool:  # no comm hook: DDP's own all-reduce can carry the probe and sentinel
        return self.comm_hook.name is None and self._ddp_comm_hook is None

    @property
    def settled(self) -> bool:
        """No re-wrap is pending (the unused-parameter window, ``comm_hook="auto"`` measuring): steps are steady."""
        return not self._unused.in_window and not self._hooks.by_moment["boundary"]

    @property
    def _attached_trainer(self) -> pl.Trainer | None:  # Lightning's own tests run hooks without one
        return getattr(self.lightning_module, "_trainer", None)

    @property
    def _module(self) -> pl.LightningModule:
        return cast(pl.LightningModule, self.lightning_module)  # connected by Trainer.fit/validate/test

    @property
    def _wrapped(self) -> torch.nn.Module:
        return cast(torch.nn.Module, self.model)
