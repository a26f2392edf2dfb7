"""SoloDDP: Lightning's DDPStrategy with defaults that are right for 1..N devices.

Example::

    import lightning as L
    from lightning_solo import SoloDDP

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP())   # or strategy="solo_ddp"
    trainer.fit(model, datamodule)
    print(trainer.strategy.decisions)        # what SoloDDP chose on your behalf, and why

Wiring only: each Lightning hook is overridden once and calls the features in the order they run; the per-step
moments go through :mod:`lightning_solo.ddp.component`, so a feature that is off costs no call. Every choice made
for the user is a :class:`~lightning_solo.core.decision.Decision` in ``decisions``. The options, each with its
feature's page: docs/soloddp.md.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
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

from lightning_solo.checkpoint.io import SoloCheckpointIO
from lightning_solo.core import cluster, cpu_malloc
from lightning_solo.core.checks import check_bool, check_number
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.ddp import comm, syncbn
from lightning_solo.ddp import precision as amp
from lightning_solo.ddp.advice import ddp_advice
from lightning_solo.ddp.compile import CompiledSteps, CompileSetting
from lightning_solo.ddp.compiled_keys import CompiledKeys
from lightning_solo.ddp.component import StepHooks
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
        unused = UnusedParameters(find_unused_parameters, static_graph=bool(ddp_kwargs.get("static_graph")))
        comm_hooks = comm.make_comm_hook(
            comm_hook, ddp_kwargs, rewraps=unused.in_window, powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter, local_sgd_period=local_sgd_period, local_sgd_warmup=local_sgd_warmup,
        )  # fmt: skip
        precision_options = amp.precision_options(precision, scaler, skip_lr_on_overflow)
        if precision is not None and precision_plugin is not None:
            raise ValueError("pass either precision= or precision_plugin= to SoloDDP, not both")
        if not isinstance(timeout, timedelta):
            timeout = timedelta(
                seconds=check_number("timeout", timeout, what="a positive number of seconds or a timedelta")
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else SoloCheckpointIO(),
            precision_plugin=precision_plugin
            if precision_plugin is not None
            else amp.pending_plugin(precision_options),
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=launcher.value,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=unused.initial,
            **ddp_kwargs,
        )
        self.decisions: dict[str, Decision] = {}
        self._decide(launcher)
        # The components, each with its own state.
        self._unused = unused
        self._comm = comm_hooks
        self._resume = ExactResume(enabled=check_bool("exact_resume", exact_resume))
        self._compile = CompiledSteps(compile)
        self._compiled_keys = CompiledKeys(strip_compiled_prefix)
        self._sigterm = SigtermSetting(sigterm_agreement, sigterm_checkpoint)  # each fit's agreement
        self._uneven = UnevenData(uneven_data)
        # Settings, read when the fit reaches them.
        self._syncbn = syncbn.LayerSyncChoice(sync_batchnorm, sync_batchnorm_threshold)
        self._precision_options = precision_options
        self._exact_eval = bool(exact_eval)
        self._cpu_malloc_reuse = check_bool("cpu_malloc_reuse", cpu_malloc_reuse)
        self._watchdog = WatchdogSession(watchdog)
        self._groups = comm.SideGroups(gloo=gloo_side_group)  # made at the first setup
        self._hooks = StepHooks()  # the training-step moments of the features taking part (ddp/component.py)
        self._advice: list[str] = []
        self._rewrap_listeners: list[Callable[[], Callable[[DistributedDataParallel], Any] | None]] = []  # weak
        self._decide(decide_exact_eval(self._exact_eval))
        self._decide(unused.decision)
        self._decide(self._watchdog.decision)
        self._decide(self._compile.decision)
        if (keys := self._compiled_keys.decision(None)) is not None:  # stripping: the user's setting
            self._decide(keys)

    # ----------------------------------------------------------------------------------------- public seams
    @property
    def comm_hook(self) -> comm.CommHook:
        """The gradient communication (``comm_hook=``): ``name``, ``state_dict()``, for "auto" ``measured_ms``."""
        return self._comm

    @property
    def barrier_group(self) -> Any:
        """The monitored barrier's gloo group (the world, or a side group under NCCL); ``None``: a plain barrier."""
        return self._groups.barrier

    @property
    def side_group(self) -> Any:
        """A gloo group apart from DDP's for collectives beside training; ``None`` before setup or without gloo."""
        return self._groups.side_group

    @property
    def sync_batchnorm_threshold(self) -> int:
        """The per-device batch size below which ``sync_batchnorm="auto"`` synchronises."""
        return self._syncbn.threshold

    @property
    def advice(self) -> list[str]:
        """The end-of-fit advice from DDP's logging data (:mod:`lightning_solo.ddp.advice`)."""
        return self._advice

    def add_rewrap_listener(self, listener: Callable[[DistributedDataParallel], Any]) -> None:
        """Call ``listener(old)`` before this fit drops its DDP wrapper ``old`` for a new one (stock never re-wraps):
        read ``old`` then and keep no reference (its buckets are as big as the gradients). Held weakly, forgotten
        at the end of the fit."""
        held = weakref.WeakMethod(listener) if inspect.ismethod(listener) else weakref.ref(listener)
        self._rewrap_listeners.append(held)

    def heartbeats(self) -> dict[int, Heartbeat]:
        """Each rank's latest heartbeat as this rank's watchdog read it (ranks 0 and W-1 read all); empty without."""
        return self._watchdog.heartbeats()

    def state_dict(self) -> dict[str, Any]:
        """What the last fit left to report (``decisions``, ``advice``), for a notebook parent to take back."""
        return {"decisions": dict(self.decisions), "advice": list(self._advice)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a fit's :meth:`state_dict` (a notebook parent, after its ranks' fit)."""
        self.decisions.update(state.get("decisions", {}))
        self._advice = list(state.get("advice", self._advice))

    def settings(self) -> dict[str, Any]:
        """The effective DDP settings, for the run summary."""
        return {
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "backend": self.process_group_backend,
            "start_method": self._start_method,
            "timeout_s": self._timeout.total_seconds() if self._timeout else None,
            **self._ddp_kwargs,
        }

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            return super()._configure_launcher()
        # fork/spawn/forkserver: the parent gets the fit's state back and can fit again (lightning_solo.ddp.launcher).
        self._launcher = SoloLauncher(self, start_method=self._start_method)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        # Only our own names: the inherited method would re-register "ddp" and raise.
        for name, start_method, description in (
            ("solo_ddp", "auto", "SoloDDP: DDP with sound multi-device defaults"),
            ("solo_ddp_notebook", "fork", "SoloDDP with the fork launcher, for Jupyter/IPython"),
        ):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, start_method=start_method)

    @override
    def setup_environment(self) -> None:
        backend = self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        if (recorder := self._watchdog.prepare_environment(backend)) is not None:
            self._decide(recorder)
        super().setup_environment()  # the device, then the process group
        self._watchdog.restore_environment()  # torch read it making the group: it outlives no step of the fit
        # torchrun / SLURM started the processes, not the start method chosen above.
        if (launched := cluster.decide_external_launch(self.cluster_environment)) is not None:
            self._decide(launched)
        # Every rank can take part now: the placeholder precision plugin settles ("auto" is agreed by all ranks).
        self.precision_plugin, decisions = amp.decide_precision_plugin(
            self.precision_plugin, self._precision_options, self._attached_trainer, self.root_device
        )
        for decision in decisions:
            self._decide(decision)
        if self.root_device.type == "cpu":  # the threads Lightning's launchers left each rank; glibc's malloc
            self._decide(Decision("cpu_threads", torch.get_num_threads(), "cores split between local processes"))
            self._decide(cpu_malloc.decide(reuse=self._cpu_malloc_reuse))
        self._decide(Decision("process_group_backend", self.process_group_backend, "nccl on CUDA, gloo otherwise"))
        # The monitored barrier's group: once per process, every rank alike (one rank per node warns).
        warn = self.num_nodes > 1 and self.local_rank == 0
        if (barrier := self._groups.setup(self._collective_timeout, self.root_device, warn)) is not None:
            self._decide(barrier)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._decide(self._syncbn.choose(self, trainer))  # the plugin DDPStrategy's setup converts with
            # Every fit decides from its own evidence (a second fit in a notebook, another datamodule...).
            self._unused = self._unused.fresh()
            self._ddp_kwargs["find_unused_parameters"] = self._unused.initial
            self._decide(self._unused.decision)
            # Compiled before DDP wraps it, inside DDP's forward at run time (lightning_solo.ddp.compile).
            self._compile = self._compile.fresh()
            self._decide(self._compile.setup(trainer.lightning_module))
        if (keys := self._compiled_keys.decision(trainer.lightning_module)) is not None:  # every run
            self._decide(keys)
        # SyncBN converted (fitting), then DDP: _setup_model, _register_ddp_hooks, _enable_model_averaging.
        super().setup(trainer)
        # Every run (fit, validate, test, predict), before its loaders are processed; every rank alike.
        group = self._side_channel() if self._uneven.policy and self.world_size > 1 else None
        self._decide(self._uneven.setup(self.world_size, group))
        if fitting:  # before Lightning registers its signal handlers; every rank alike
            self._sigterm.install(trainer, self._side_channel, self._decide)
            self._watchdog.start(trainer, self.global_rank, self.world_size, self._collective_timeout)
        self._rebuild_hooks()

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # Wrapped by the unused-parameter policy (in its evidence window with a probe parameter).
        return self._unused.wrap(model, self._build_ddp, self._side_channel(), probe=self._exact_allreduce)

    def _build_ddp(self, module: torch.nn.Module) -> DistributedDataParallel:
        if not self._comm.own_replica:
            return super()._setup_model(module)
        self._comm.own_replica = False  # each rank resumed its own replica: DDP broadcasts none over it
        kwargs, self._ddp_kwargs = self._ddp_kwargs, {**self._ddp_kwargs, "init_sync": False}
        try:
            return super()._setup_model(module)
        finally:
            self._ddp_kwargs = kwargs

    @override
    def _register_ddp_hooks(self) -> None:
        self._decide(self._comm.register_on(self))

    @override
    def _enable_model_averaging(self) -> None:
        super()._enable_model_averaging()  # checks the optimizers, makes Lightning's PeriodicModelAverager
        # The comm hook averages instead (CommHook.average_after_step): on the same schedule, in place (keeps
        # channels_last), its step restored on resume, and over every trainable parameter: Lightning's takes
        # those with a gradient, and after a local step a parameter one rank did not use has none there, so the
        # ranks would average different tensors. DDPStrategy.optimizer_step then averages nothing.
        self._comm.attach_averager(self._model_averager)  # type: ignore[arg-type]
        self._model_averager = None

    # ---------------------------------------------------------------------------------------------- loaders
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self._attached_trainer
        if trainer is not None and trainer.training:  # resumable, the resume plan attached
            dataloader = self._resume.on_dataloader(dataloader, trainer, self._decide)
        # Outside the resumable loader: read ahead and its end agreed (an IterableDataset's; training and eval).
        dataloader = self._uneven.on_dataloader(dataloader, trainer)
        # Every loader's workers leave a SIGTERM that is not their rank's to the ranks (lightning_solo.ddp.sigterm).
        return self._sigterm.shield_workers(dataloader)

    @override
    def on_train_start(self) -> None:
        # The resume plan settles before the epoch loop reads the batch counters it rewinds.
        self._resume.close_loaders(self._module.trainer)
        super().on_train_start()
        self._watchdog.data_wait(self._module.trainer.global_step)
        # Made after setup, while restoring a checkpoint (e.g. the GradScaler kept across a resume).
        for decision in getattr(self.precision_plugin, "decisions", {}).values():
            self._decide(decision)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        trainer = self._attached_trainer
        if trainer is not None and trainer.training and not trainer.sanity_checking:
            for hook in self._hooks.by_moment["batch"]:
                hook(trainer)
        return super().batch_to_device(batch, device, dataloader_idx)

    # ------------------------------------------------------------------------------------------------ steps
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # A batch boundary: the policy decides alike on every rank (from all-reduced evidence and the trainable
        # set), so every rank re-wraps together; comm_hook="auto" re-wraps between its trials too.
        rewrap = self._unused.at_boundary(self._wrapped)
        for hook in self._hooks.by_moment["boundary"]:  # comm_hook="auto" between its trials
            rewrap |= hook(self)
        if rewrap:
            self._rewrap()
        if self.decisions.get("find_unused_parameters") is not self._unused.decision:
            self._decide(self._unused.decision)
        for hook in self._hooks.by_moment["batch_start"]:  # compile="auto" times steady steps (see settled)
            hook(self)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._unused.step_context(self._note_reentrant), self._around("step", self):
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Strategy.backward, with the unused-parameter steps right around the precision plugin's backward, before
        # on_after_backward: a collective there (self.log(..., sync_dist=True)) must not meet a bucket DDP holds.
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
            # Its backward is a collective inside backward: "auto" leaves the fast path at the next boundary, and
            # until then that collective runs on the side channel, apart from DDP's buckets.
            self._unused.note_backward_collective("all_gather(sync_grads=True)")
            if self._unused.on_fast_path:
                return all_gather_grad_on(tensor, group, self._side_channel())
        with self._around("collective", "all_gather"):
            return super().all_gather(tensor, group, sync_grads)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Lightning averages the integer sample counts behind sync_dist epoch means with truncation: those (and
        # only those, not a user's own integer tensor) average in float.
        if self._exact_eval:
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
        # A monitored barrier names the ranks that never arrived instead of hanging until the NCCL/gloo timeout.
        with self._around("collective", f"barrier {name!r}" if name else "barrier"):
            if self._groups.barrier is None or not torch.distributed.is_initialized():
                return super().barrier(name, *args, **kwargs)
            comm.monitored_barrier(name, self._collective_timeout, self._groups.barrier)

    # ------------------------------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        with self._watchdog.phase(hb.CHECKPOINT_SAVE):
            self.add_resume_state(checkpoint, filepath=filepath)
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def add_resume_state(self, checkpoint: dict[str, Any], collective: bool = True, filepath: Any = None) -> None:
        """Put the resume record and the comm-hook state into ``checkpoint``. ``collective=False`` (the save
        on an exception, which must not wait on other ranks): this rank's record and hook state only."""
        self._resume.add_to_checkpoint(checkpoint, self._attached_trainer, collective)
        self._comm.add_to_checkpoint(checkpoint, filepath, collective)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The weights of every checkpoint Lightning writes: compiled submodules under their eager keys.
        return self._compiled_keys.save(super().lightning_module_state_dict(), self._module)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Before setup on fit(ckpt_path=...): either spelling of a compiled submodule's keys, in the module's own.
        if (keys := self._compiled_keys.decision(self._module)) is not None:
            self._decide(keys)
        state_dict = self._compiled_keys.load(checkpoint["state_dict"], self._module)
        super().load_model_state_dict({**checkpoint, "state_dict": state_dict}, strict=strict)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if os.fspath(checkpoint_path) == "auto":  # rank 0 chooses, every rank checks it sees that file
            if weights_only is None:
                weights_only = getattr(self.checkpoint_io, "weights_only", True)
            checkpoint, checkpoint_path = load_auto_checkpoint(
                self._module.trainer, self.global_rank, self.broadcast, self._decide, weights_only
            )
            if checkpoint_path is None:
                return checkpoint  # none: a falsy checkpoint, the fit starts fresh
        else:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume.on_load_checkpoint(checkpoint)
        self._comm.on_load_checkpoint(checkpoint, checkpoint_path)  # post-local-SGD: maybe this rank's own model
        return checkpoint

    # ---------------------------------------------------------------------------------------------- the end
    @override
    def on_train_end(self) -> None:
        # Not the end of the fit: a LearningRateFinder callback runs the fit loop (and this hook) before the real
        # fit goes on with the same DDP wrapper. What ends with the fit happens in teardown (_end_fit).
        super().on_train_end()
        if self._comm.averager is not None:
            # Post-local-SGD: between averages the ranks' models differ; end on their average, not rank 0's.
            self._comm.average_parameters(self._module)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Not DDPStrategy's rewrite of DDP's unused-parameter error: it names Lightning's strategies.
        self._watchdog.on_exception(exception)  # names a peer whose process ended (the error names none)
        self._unused.stop()
        explain_exception(exception, self._unused)

    @override
    def teardown(self) -> None:
        trainer = self._attached_trainer
        if (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING  # not after an exception (INTERRUPTED)
        ):
            self._end_fit()
        self._rewrap_listeners = []  # also after an exception
        self._hooks = StepHooks()
        self._watchdog.teardown()
        self._sigterm.uninstall()
        self._uneven.uninstall()
        self._resume.reset()
        self._compile.teardown()
        with self._syncbn.around_teardown(self):
            super().teardown()  # unwraps DDP, reverts SyncBN with the plugin setup chose
        cpu_malloc.restore()  # the fit's malloc setting ends with it (lightning_solo.core.cpu_malloc)

    # ---------------------------------------------------------------------------------------------- helpers
    def _end_fit(self) -> None:
        """The fit completed, on every rank: the collectives in flight settle, the decisions and advice are final."""
        self._sigterm.close()  # the agreement in flight
        self._watchdog.stop()  # "done" at once: no peer takes this rank's exit for a death
        self._unused.finish(self._wrapped)
        self._decide(self._unused.decision)
        self._decide(self._compile.finish())
        if self._compile.fallback is not None:
            self._decide(self._compile.fallback)
        if isinstance(self.model, DistributedDataParallel):
            self._advice = ddp_advice(self.model, self._unused)
            rank_zero_info("SoloDDP advice:\n" + "\n".join(f"  - {line}" for line in self._advice))

    def _side_channel(self) -> Any:
        return self._groups.side(self._timeout)

    def _rewrap(self) -> None:
        self._ddp_kwargs["find_unused_parameters"] = self._unused.find_unused
        # Not Lightning's _setup_model: it builds DDP on a side stream that does not wait for the optimizer step
        # still running on the current one, and DDP's initial broadcast would then send rank 0's half-updated
        # parameters. The replicas are in step already (post-local-SGD: deliberately not, between averages), so
        # no broadcast at all.
        kwargs = {**self._ddp_kwargs, "init_sync": False}
        device_ids = self.determine_ddp_device_ids()
        # The old wrapper's reducer owns gradient buckets as big as all the gradients: it is read out, unwrapped
        # and dropped before the next one is built, or a device near full memory runs out right here.
        old = cast(DistributedDataParallel, self.model)  # DDP since setup
        for ref in self._rewrap_listeners:
            if (listener := ref()) is not None:
                listener(old)
        self.model = module = self._unused.unwrap(old, keep_grads=not self._module.automatic_optimization)
        gone = weakref.ref(old)
        del old
        if gone() is not None:  # a reference cycle would keep it (and its buckets) until the next collection
            gc.collect()
        self.model = self._unused.rebuild(
            module,
            lambda module: DistributedDataParallel(module, device_ids=device_ids, **kwargs),
            self._side_channel(),
            exact_allreduce=self._exact_allreduce,
        )
        self._register_ddp_hooks()
        self._rebuild_hooks()  # comm_hook="auto" takes no part once decided

    def _around(self, moment: str, *args: Any) -> contextlib.AbstractContextManager[Any]:
        """The contexts of the features taking part in ``moment`` (ddp/component.py); none: no call made."""
        return self._hooks.around(moment, *args) if self._hooks.by_moment[moment] else contextlib.nullcontext()

    def _rebuild_hooks(self) -> None:
        self._hooks.rebuild([self._comm, self._watchdog, self._compile, self._resume])

    def _note_reentrant(self) -> None:
        if "reentrant_checkpoint" not in self.decisions:
            self._decide(REENTRANT_CHECKPOINT)

    def __getstate__(self) -> dict:
        # Weak references do not pickle; the listeners belong to the process that registered them.
        return {**super().__getstate__(), "_rewrap_listeners": []}

    @property
    def _exact_allreduce(self) -> bool:
        """No comm hook, ours or the user's: DDP's own all-reduce can carry the policy's probe and sentinel."""
        return self._comm.name is None and self._ddp_comm_hook is None

    @property
    def settled(self) -> bool:
        """No re-wrap is pending from the unused-parameter policy or a feature taking part in batch boundaries
        (``comm_hook="auto"`` while it measures): steps are steady."""
        return not self._unused.in_window and not self._hooks.by_moment["boundary"]

    @property
    def _attached_trainer(self) -> pl.Trainer | None:
        """The Trainer once the LightningModule is attached to one (Lightning's own tests run hooks without)."""
        return getattr(self.lightning_module, "_trainer", None)

    @property
    def _module(self) -> pl.LightningModule:
        if (module := self.lightning_module) is None:
            raise RuntimeError("SoloDDP has no LightningModule yet: it is connected by Trainer.fit/validate/test")
        return module

    @property
    def _wrapped(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("SoloDDP has no model yet: it is connected by Trainer.fit/validate/test")
        return self.model

    @property
    def _collective_timeout(self) -> timedelta:
        return cast(timedelta, self._timeout)  # always one: __init__ makes it
