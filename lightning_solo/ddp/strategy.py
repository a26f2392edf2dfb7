"""SoloDDP: Lightning's DDPStrategy with defaults that are right for 1..N devices.

Example::

    import lightning as L
    from lightning_solo.ddp.strategy import SoloDDP

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP())   # or strategy="solo_ddp"
    trainer.fit(model, datamodule)
    print(trainer.strategy.decisions)        # what SoloDDP chose on your behalf, and why

Wiring only: SoloDDP overrides each Lightning hook once, and the hook's body calls the components in the order they
run: the unused-parameter policy (:class:`~lightning_solo.ddp.unused.policy.UnusedParameters`), the gradient
communication (:class:`~lightning_solo.ddp.comm.CommHook`), exact resume
(:class:`~lightning_solo.ddp.resume.session.ExactResume`), exact eval means (:mod:`lightning_solo.ddp.eval`),
``compile=`` (:class:`~lightning_solo.ddp.compile.CompiledSteps`), compiled submodules' checkpoint keys
(:class:`~lightning_solo.ddp.compiled_keys.CompiledKeys`), the SIGTERM agreement (:mod:`lightning_solo.ddp.sigterm`),
the uneven-data agreement (:mod:`lightning_solo.ddp.uneven`) and the hang watchdog (:mod:`lightning_solo.ddp.watchdog`).
Every choice made for the user is a
:class:`~lightning_solo.core.decision.Decision` in ``decisions``. Callbacks, the launcher, the app and the
diagnostics read only the public seams: ``comm_hook``, ``barrier_group``, ``side_group``,
``sync_batchnorm_threshold``, ``decisions``, ``advice``, ``heartbeats()``, ``record()``, ``add_resume_state()``,
``add_rewrap_listener()``, ``state_dict()``.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
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
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.checkpoint.io import SoloCheckpointIO
from lightning_solo.core import cluster, cpu_malloc
from lightning_solo.core.checks import check_bool, check_number
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.ddp import comm, syncbn
from lightning_solo.ddp import precision as amp
from lightning_solo.ddp.advice import ddp_advice
from lightning_solo.ddp.compile import CompiledSteps, CompileSetting
from lightning_solo.ddp.compiled_keys import CompiledKeys
from lightning_solo.ddp.eval import mean_operand
from lightning_solo.ddp.launcher import SoloLauncher, StartMethod, decide_start_method
from lightning_solo.ddp.resume.session import ExactResume, load_auto_checkpoint
from lightning_solo.ddp.sigterm import SigtermAgreement, install_agreement
from lightning_solo.ddp.uneven import Policy as UnevenPolicy
from lightning_solo.ddp.uneven import UnevenData
from lightning_solo.ddp.unused.fast_path import all_gather_grad_on
from lightning_solo.ddp.unused.messages import REENTRANT_CHECKPOINT, explain_exception
from lightning_solo.ddp.unused.policy import Phase, UnusedParameters
from lightning_solo.ddp.unused.watch import search_safe_checkpointing, watch_collectives
from lightning_solo.ddp.watchdog import Heartbeat, WatchdogSession
from lightning_solo.ddp.watchdog import heartbeat as hb


class SoloDDP(DecisionLog, DDPStrategy):
    """DDP with sound defaults: ``gradient_as_bucket_view=True``, a launcher chosen by context,
    nccl on CUDA and gloo on CPU. A SIGTERM on any rank stops every rank at the same batch, without Lightning's
    per-batch broadcast (:mod:`lightning_solo.ddp.sigterm`).

    Args:
        gradient_as_bucket_view: let gradients alias DDP's buckets (saves one copy of the gradients).
        find_unused_parameters: ``"auto"`` (default), ``True`` or ``False``. ``"auto"``: the first steps on
            ``True`` as evidence, then DDP's fast path if every parameter was used (parameters never used are
            named and excluded), else ``True``; ``True`` also whenever something communicates inside backward
            (SyncBN, ``all_gather(sync_grads=True)``). On the fast path a parameter that goes unused later is
            completed exactly as ``True`` would, then ``True``. Whatever the setting, DDP is re-wrapped when the
            set of trainable parameters changes (fine-tuning), so every trainable parameter is synchronised.
            See :mod:`lightning_solo.ddp.unused.policy`. The end-of-fit advice from DDP's logging data is in ``self.advice``.
        start_method: ``"auto"`` (fork in notebooks, popen in scripts), or one of Lightning's launchers. With
            fork/spawn/forkserver, the notebook gets the fit's state back (true ``global_step``, callback state,
            decisions) and can fit again on the same Trainer: see :mod:`lightning_solo.ddp.launcher`.
        timeout: collective timeout, a ``timedelta`` or seconds.
        checkpoint_io: defaults to :class:`~lightning_solo.checkpoint.io.SoloCheckpointIO` (atomic, fsynced,
            manifest-verified files, ``weights_only=True`` loads). Every checkpoint also carries the training
            sampler's position and every rank's RNG states, so a mid-epoch resume continues exactly
            (:mod:`lightning_solo.ddp.resume.record`).
        sync_batchnorm: ``True``, ``False`` or ``"auto"``: synchronise BatchNorm statistics over the global
            batch with a backend-agnostic SyncBN (works on CPU/gloo), reverted to the original classes
            after fit. ``"auto"`` turns it on when there is BatchNorm, more than one process and a
            per-device batch below ``sync_batchnorm_threshold`` (see :func:`lightning_solo.ddp.syncbn.decide`).
            ``Trainer(sync_batchnorm=True)`` counts as ``True``.
        sync_batchnorm_threshold: per-device batch size below which ``"auto"`` synchronises.
        precision: ``"auto"``, ``"bf16-mixed"``, ``"16-mixed"`` (fp16 + GradScaler, real fp16 on CPU too),
            ``"32-true"``, or ``None`` to leave it to ``Trainer(precision=...)``. ``"auto"``: bf16 on GPUs that
            support it, fp16 on GPUs that don't, fp32 on CPU. A different explicit ``Trainer(precision=...)``
            raises ``ValueError`` (``"auto"`` defers to it; the Trainer's ``"32-true"`` counts as unset, being
            its default); see :func:`lightning_solo.ddp.precision.decide_precision`.
        scaler: GradScaler settings for 16-mixed: ``init_scale``, ``growth_factor`` (> 1), ``backoff_factor``
            (in (0, 1)), ``growth_interval`` (>= 1). On resume the saved scale is kept and these factors apply.
        skip_lr_on_overflow: hold step-interval LR schedulers on a step skipped for inf/nan gradients.
        comm_hook: gradient communication, registered on every device (gloo/CPU too, unlike Lightning):
            ``None`` (exact all-reduce), ``"fp16"``, ``"bf16"``, ``"powersgd"`` (its state is checkpointed and
            restored), or ``"post_local_sgd"`` (local steps outside DDP's reducer, parameters averaged every
            ``local_sgd_period`` steps after ``local_sgd_warmup`` synchronous ones; every rank resumes its own
            replica; the model is averaged once more at the end of fit), or ``"auto"`` (each of exact, fp16, bf16, powersgd for a few steps, the fastest kept:
            :mod:`lightning_solo.ddp.comm.auto`). See :class:`lightning_solo.ddp.comm.CommHook`. Lightning's
            ``ddp_comm_hook=`` callables are also registered on every device.
        powersgd_rank, powersgd_start_iter, local_sgd_period, local_sgd_warmup: the comm hook's options, as
            :class:`~lightning_solo.ddp.comm.CommHook` takes them (``None``: its default).
        exact_eval: ``sync_dist`` epoch means count the samples exactly (Lightning averages the integer sample
            counts with truncation: 101 samples on 2 ranks count as 50). The evaluation loaders stay Lightning's
            (``DistributedSampler``: every rank the same batches, up to ``W - 1`` padding repeats), and
            :func:`lightning_solo.ddp.eval.eval_rows` names the repeats for a module to drop. ``False``:
            Lightning's means.
        exact_resume: exact mid-epoch resume (default): training samples load with RNGs seeded from (seed, epoch,
            index) (per batch for a dataset with ``__getitems__``), and a validation inside fit leaves the
            training RNG as it found it, so random streams differ from stock Lightning's (the ``resumable_data``
            decision says which). ``False``: Lightning's own training loader and RNG streams, and a mid-epoch
            resume restarts the epoch's data as stock does.
        cpu_malloc_reuse: on CPU, keep freed tensor memory in glibc's heap for the next step instead of
            faulting fresh pages in every step, until the fit ends (glibc's starting thresholds after it; left
            alone where jemalloc/tcmalloc is preloaded or glibc's malloc is set in the environment):
            :mod:`lightning_solo.core.cpu_malloc`.
        sigterm_agreement: a SIGTERM on any rank stops every rank at the same batch, agreed asynchronously on a
            gloo group (:mod:`lightning_solo.ddp.sigterm`); ``False``: Lightning's per-batch broadcast of rank 0's flag.
        sigterm_checkpoint: on that agreed stop every rank saves ``on_sigterm.ckpt`` in the checkpoint callback's
            directory, which ``resume=auto`` and ``fit(ckpt_path="auto")`` pick up; ``False``: stop without saving,
            as stock.
        uneven_data: ``"shortest"`` (default): where the ranks' ``IterableDataset`` loaders (training or
            evaluation) run out at different batches, every rank ends at the batch where the first one does, agreed
            asynchronously at each batch (:mod:`lightning_solo.ddp.uneven`); ``False``: as stock, where uneven data
            hangs or fails.
        watchdog: a proven hang (a rank's process ended, a collective mismatch, a rank finished while another
            waits) ends the run with one line naming the rank, its phase and step, and what the others wait in, each
            rank's Python stacks in ``<default_root_dir>/hang/``, and exit status 86; a rank only busy past its
            phase's allowance is reported, and ended at the collective timeout with that line:
            :mod:`lightning_solo.ddp.watchdog`. A mapping sets
            :class:`~lightning_solo.ddp.watchdog.WatchdogSettings` fields (``{"abort_after_s": 600}``); ``False``: off.
            torch's flight recorder is switched on too (``TORCH_FR_BUFFER_SIZE=2000``, and under NCCL
            ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``; unless set), and the line says which rank issued a collective the
            others never entered.
        compile: ``False`` (default, stock: eager unless ``fit(torch.compile(model))``), ``True``, a dict of
            ``torch.compile`` options, or ``"auto"`` (compiled and eager steps timed once the unused-parameter
            policy and the comm hook settle; compile kept if its steady gain pays back the compile time within
            the planned steps). The LightningModule's steps are compiled inside DDP's forward, so DDPOptimizer
            keeps the overlap and re-wraps recompile nothing: :mod:`lightning_solo.ddp.compile`.
        strip_compiled_prefix: ``False`` (default, stock): a compiled submodule (``self.net = torch.compile(Net())``)
            saves torch's keys (``net._orig_mod.weight``), which ``Model.load_from_checkpoint`` of that class needs;
            ``True``: the eager module's keys (``net.weight``). Either way a checkpoint loads through the Trainer with
            either spelling into either module, so it moves between compiled and eager runs:
            :mod:`lightning_solo.ddp.compiled_keys`.
        **ddp_kwargs: passed to :class:`torch.nn.parallel.DistributedDataParallel` (``bucket_cap_mb``,
            ``static_graph``, ``broadcast_buffers``, ...).
    """

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
        comm.check_bucket_cap_mb(ddp_kwargs.get("bucket_cap_mb"))
        if unused.phase is Phase.WINDOW and type(ddp_kwargs.get("ddp_comm_state")) is PowerSGDState:
            raise ValueError(
                "torch's PowerSGDState keys its error feedback to DDP's bucket layout, which changes when "
                "find_unused_parameters='auto' re-wraps DDP: use SoloDDP(comm_hook='powersgd') (the same "
                "algorithm, carried across re-wraps and checkpoints), or set find_unused_parameters=True/False"
            )
        # Only what was given: the defaults live in CommHook alone.
        given = dict(powersgd_rank=powersgd_rank, powersgd_start_iter=powersgd_start_iter,
                     local_sgd_period=local_sgd_period, local_sgd_warmup=local_sgd_warmup)  # fmt: skip
        comm_hooks = comm.make_comm_hook(comm_hook, **{k: v for k, v in given.items() if v is not None})
        if comm_hook is not None and ddp_kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("pass either comm_hook= or Lightning's ddp_comm_hook= to SoloDDP, not both")
        syncbn.validate(sync_batchnorm, sync_batchnorm_threshold)
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
        self._sigterm: SigtermAgreement | None = None  # installed by each fit's setup
        self._uneven = UnevenData(uneven_data)
        # Settings, read when the fit reaches them.
        self._sync_batchnorm = sync_batchnorm
        self._sync_batchnorm_threshold = sync_batchnorm_threshold
        self._layer_sync_request: Any = None  # Trainer(sync_batchnorm=...)'s plugin, once setup read it
        self._layer_sync_read = False
        self._precision_options = precision_options
        self._exact_eval = bool(exact_eval)
        self._cpu_malloc_reuse = check_bool("cpu_malloc_reuse", cpu_malloc_reuse)
        self._sigterm_agreement = check_bool("sigterm_agreement", sigterm_agreement)
        self._sigterm_checkpoint = check_bool("sigterm_checkpoint", sigterm_checkpoint)
        self._watchdog = WatchdogSession(watchdog)
        self._groups = comm.SideGroups(gloo=gloo_side_group)  # made at the first setup
        self._own_replica_restored = False  # a post-local-SGD checkpoint gave each rank its own model
        self._advice: list[str] = []
        self._rewrap_listeners: list[
            Callable[[], Callable[[DistributedDataParallel], Any] | None]
        ] = []  # weak
        self._decide(
            Decision(
                "exact_eval",
                self._exact_eval,
                "sync_dist epoch means average the sample counts in float (Lightning truncates them); eval "
                "loaders are Lightning's, their padding repeats named by eval_rows"
                if self._exact_eval
                else "set by the user: Lightning's integer-truncated sync_dist means",
            )
        )
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
        """The monitored barrier's group: the world when it runs gloo, a gloo side group under NCCL; ``None``: a
        plain barrier (no gloo to be had, or no live process group yet)."""
        return self._groups.barrier

    @property
    def side_group(self) -> Any:
        """A gloo group apart from DDP's, for collectives beside training (unused-parameter evidence, the SIGTERM
        and requeue agreements); ``None`` before the first setup makes it, or where gloo cannot be had."""
        return self._groups.side_group

    @property
    def sync_batchnorm_threshold(self) -> int:
        """The per-device batch size below which ``sync_batchnorm="auto"`` synchronises."""
        return self._sync_batchnorm_threshold

    @property
    def advice(self) -> list[str]:
        """The end-of-fit advice from DDP's logging data (:mod:`lightning_solo.ddp.advice`)."""
        return self._advice

    def add_rewrap_listener(self, listener: Callable[[DistributedDataParallel], Any]) -> None:
        """Call ``listener(old)`` whenever this fit is about to drop its DDP wrapper ``old`` to build the next one
        (the unused-parameter policy's decisions, a change of the trainable set, ``comm_hook="auto"``'s trials):
        read what is needed from ``old`` then, and keep no reference to it. Its reducer owns gradient buckets as
        big as all the gradients, which the next wrapper's must not meet. Held weakly (a bound method as long as
        its object lives: a lambda would be gone at once), so it never travels when the strategy is pickled;
        forgotten at the end of the fit. Stock DDPStrategy never re-wraps."""
        held = weakref.WeakMethod(listener) if inspect.ismethod(listener) else weakref.ref(listener)
        self._rewrap_listeners.append(held)

    def heartbeats(self) -> dict[int, Heartbeat]:
        """Each rank's latest heartbeat (step, phase, seconds in it, the collective it waits in) as this rank's
        watchdog last read it (ranks 0 and W-1 read every rank's; the others their own); empty without a watchdog
        (``watchdog=False``, one process, outside a fit)."""
        return self._watchdog.heartbeats()

    def state_dict(self) -> dict[str, Any]:
        """What the last fit left to report (``decisions``, ``advice``), for a notebook parent to take back."""
        return {"decisions": dict(self.decisions), "advice": list(self._advice)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a fit's :meth:`state_dict` (the notebook parent, after its ranks' fit): its decisions over the
        parent's own, its advice."""
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
        # torchrun / SLURM started the processes, not the start method chosen above.
        if (launched := cluster.decide_external_launch(self.cluster_environment)) is not None:
            self._decide(launched)
        # Every rank can take part now: settle the placeholder precision plugin ("auto" is agreed by all ranks, a
        # collective); nothing uses it before. (Without a LightningModule, as in Lightning's own tests,
        # Trainer(precision=...) is unknown.)
        self.precision_plugin, decisions = amp.decide_precision_plugin(
            self.precision_plugin, self._precision_options, self._attached_trainer, self.root_device
        )
        for decision in decisions:
            self._decide(decision)
        if self.root_device.type == "cpu":
            # Lightning's launchers already split the cores between local ranks; record what is in force.
            self._decide(
                Decision("cpu_threads", torch.get_num_threads(), "cores split between local processes")
            )
            self._decide(cpu_malloc.decide(reuse=self._cpu_malloc_reuse))
        self._decide(
            Decision("process_group_backend", self.process_group_backend, "nccl on CUDA, gloo otherwise")
        )
        # The monitored barrier's group: once per process, every rank alike (one rank per node warns).
        warn = self.num_nodes > 1 and self.local_rank == 0
        if (barrier := self._groups.setup(self._collective_timeout, self.root_device, warn)) is not None:
            self._decide(barrier)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # SyncBN. Lightning's connector put Trainer(sync_batchnorm=...)'s plugin (or None) on `_layer_sync`,
            # and its TorchSyncBatchNorm fails on CPU: read that request once, and give DDPStrategy's setup
            # (which converts) and teardown (which reverts) the plugin chosen here; teardown puts the request back.
            if not self._layer_sync_read:
                self._layer_sync_request, self._layer_sync_read = self._layer_sync, True
            decision, self._layer_sync = syncbn.decide_layer_sync(
                trainer, self._sync_batchnorm, self._sync_batchnorm_threshold, self._layer_sync_request
            )
            self._decide(decision)
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
            group = self._side_channel() if self._sigterm_agreement and self.world_size > 1 else None
            self._sigterm = install_agreement(
                trainer,
                group,
                enabled=self._sigterm_agreement,
                checkpoint=self._sigterm_checkpoint,
                decide=self._decide,
            )
            self._watchdog.start(trainer, self.global_rank, self.world_size, self._collective_timeout)

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # Wrapped by the unused-parameter policy (in its evidence window with a probe parameter).
        return self._unused.wrap(model, self._build_ddp, self._side_channel(), probe=self._exact_allreduce)

    def _build_ddp(self, module: torch.nn.Module) -> DistributedDataParallel:
        if not self._own_replica_restored:
            return super()._setup_model(module)
        # Each rank resumed its own post-local-SGD replica: DDP must not broadcast rank 0's over it.
        self._own_replica_restored = False
        kwargs, self._ddp_kwargs = self._ddp_kwargs, {**self._ddp_kwargs, "init_sync": False}
        try:
            return super()._setup_model(module)
        finally:
            self._ddp_kwargs = kwargs

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only (a torch 1.8 limit, long gone): register on every device.
        if self._comm.name is None and self._ddp_comm_hook is not None:
            lightning_compat.register_ddp_comm_hook(
                self.model, self._ddp_comm_state, self._ddp_comm_hook, self._ddp_comm_wrapper
            )
            name = getattr(self._ddp_comm_hook, "__qualname__", repr(self._ddp_comm_hook))
            self._decide(Decision("comm_hook", name, "ddp_comm_hook given by the user"))
            return
        self._decide(self._comm.register(self.model, node=self.node_rank))  # type: ignore[arg-type]  # DDP here
        if self._comm.averaging_period is not None:
            # DDPStrategy.setup starts its PeriodicModelAverager when it sees a PostLocalSGDState.
            self._ddp_comm_state = self._comm.state
            self._model_averaging_period = self._comm.averaging_period

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
        return self._sigterm.shield_workers(dataloader) if self._sigterm is not None else dataloader

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
            self._resume.before_batch(trainer)  # the first resumed batch starts from the checkpoint's RNG
            self._watchdog.batch(trainer.global_step)
        return super().batch_to_device(batch, device, dataloader_idx)

    # ------------------------------------------------------------------------------------------------ steps
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # A batch boundary: the policy decides alike on every rank (from all-reduced evidence and the trainable
        # set), so every rank re-wraps together; comm_hook="auto" re-wraps between its trials too.
        rewrap = self._unused.at_boundary(self._wrapped)
        if self._comm.at_boundary(self.root_device) or rewrap:
            self._rewrap()
        if self.decisions.get("find_unused_parameters") is not self._unused.decision:
            self._decide(self._unused.decision)
        # compile="auto" times steady steps: once no re-wrap is pending; its choice is a collective.
        settled = self._unused.phase is not Phase.WINDOW and self._comm.decided
        if decision := self._compile.at_boundary(
            settled, self.root_device, lambda: self._planned_steps, self._wrapped
        ):
            self._decide(decision)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._comm.local_step and isinstance(self.model, DistributedDataParallel):
            # Post-local-SGD's local steps skip DDP's reducer, as no_sync does (see CommHook.local_step). Only
            # ever set False: Lightning's accumulation restores the flag it found when its no_sync ends.
            self.model.require_backward_grad_sync = False
        # While "auto" has DDP searching, reentrant checkpointing (which the search cannot follow) runs
        # non-reentrant (lightning_solo.ddp.unused.watch).
        searching = search_safe_checkpointing(self._note_reentrant) if self._unused.searching else None
        with (
            searching or contextlib.nullcontext(),
            self._watchdog.phase(hb.TRAINING_STEP),
            self._compile.step_context(self._wrapped),
        ):
            output = super().training_step(*args, **kwargs)
        self._resume.after_training_step()  # a batch that does not step: where a validation leaves the RNG
        return output

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Strategy.backward, with the unused-parameter steps right around the precision plugin's backward, before
        # on_after_backward: a collective there (self.log(..., sync_dist=True)) must not meet a bucket DDP holds.
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self._module)
        self._unused.before_backward(self._wrapped)
        # Evidence in the window: does anything communicate inside backward?
        watch = (
            watch_collectives(self._unused.note_backward_collective)
            if self._unused.phase is Phase.WINDOW
            else None
        )
        with watch or contextlib.nullcontext(), self._watchdog.phase(hb.BACKWARD):
            self.precision_plugin.backward(closure_loss, self._module, optimizer, *args, **kwargs)
        self._unused.after_backward(self._wrapped)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self._module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with (
            self._resume.stepping(),
            self._watchdog.phase(hb.OPTIMIZER_STEP),
        ):  # the closure runs training_step
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._comm.averager is not None:  # post-local-SGD's averager (see _enable_model_averaging)
            self._comm.average_after_step(optimizer)
        if self._comm.local_step and isinstance(self.model, DistributedDataParallel):
            # As after a synchronised step, the next forward (training or validation) broadcasts rank 0's buffers
            # (BatchNorm statistics); a forward outside the reducer would otherwise have switched that off.
            self.model.require_forward_param_sync = True
        self._comm.after_step(self.root_device)  # comm_hook="auto" times its trials
        self._compile.after_step(self.root_device)  # and compile="auto"
        self._resume.after_optimizer_step(self._module.trainer)  # the point a checkpoint's record describes
        return output

    @override
    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        if sync_grads and torch.is_grad_enabled() and torch.distributed.is_initialized():
            # Its backward is a collective inside backward: "auto" leaves the fast path at the next boundary, and
            # until then that collective runs on the side channel, apart from DDP's buckets.
            self._unused.note_backward_collective("all_gather(sync_grads=True)")
            if self._unused.phase in (Phase.FAST, Phase.EXCLUDING):  # only with a side channel
                return all_gather_grad_on(tensor, group, self._side_channel())
        with self._watchdog.collective("all_gather"):
            return super().all_gather(tensor, group, sync_grads)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Lightning averages integer tensors (the batch sizes behind sync_dist epoch means) with truncation.
        with self._watchdog.collective("reduce"):
            return super().reduce(
                mean_operand(tensor, reduce_op) if self._exact_eval else tensor, group, reduce_op
            )

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._watchdog.collective("broadcast"):
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
        with self._watchdog.collective(f"barrier {name!r}" if name else "barrier"):
            if self._groups.barrier is None or not torch.distributed.is_initialized():
                return super().barrier(name, *args, **kwargs)
            comm.monitored_barrier(name, self._collective_timeout, self._groups.barrier)

    # ------------------------------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None
    ) -> None:
        with self._watchdog.phase(hb.CHECKPOINT_SAVE):
            self.add_resume_state(checkpoint, filepath=filepath)
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def add_resume_state(
        self, checkpoint: dict[str, Any], collective: bool = True, filepath: Any = None
    ) -> None:
        """Put the resume record and the comm-hook state into ``checkpoint``. ``collective=False`` (the save
        on an exception, which must not wait on other ranks): this rank's record and hook state only."""
        self._resume.add_to_checkpoint(checkpoint, self._attached_trainer, collective)
        # A full checkpoint. Per-rank shards are a collective (rank 0 records every rank's): only with all.
        if "optimizer_states" in checkpoint and (collective or self._comm.name != "powersgd"):
            # Post-local-SGD between averages: each rank's own model and optimizer state, beside the checkpoint.
            replica = (
                {key: checkpoint[key] for key in ("state_dict", "optimizer_states")} if collective else None
            )
            if hook_state := self._comm.state_dict(filepath, replica):  # each rank writes its shard beside it
                checkpoint[comm.CHECKPOINT_KEY] = hook_state

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
        # Applied when the hook is registered; each rank reads its own shard beside the checkpoint.
        self._comm.load_state_dict(checkpoint.get(comm.CHECKPOINT_KEY), checkpoint_path)
        if (replica := self._comm.take_replica()) is not None:
            # Post-local-SGD saved between averages: this rank resumes its own model and optimizer state, which
            # Lightning restores from here (the model before DDP wraps it: see _build_ddp).
            checkpoint.update(replica)
            self._own_replica_restored = True
        return checkpoint

    # ---------------------------------------------------------------------------------------------- the end
    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._comm.averager is not None:
            # Post-local-SGD: between averages the ranks' models differ; end on their average, not rank 0's.
            self._comm.average_parameters(self._module)
        if self._sigterm is not None:
            self._sigterm.close()  # the agreement in flight
        self._watchdog.stop()  # "done" at once: no peer takes this rank's exit for a death
        self._rewrap_listeners = []
        self._unused.finish(self._wrapped)
        self._decide(self._unused.decision)
        self._decide(self._compile.finish())
        if self._compile.fallback is not None:
            self._decide(self._compile.fallback)
        if isinstance(self.model, DistributedDataParallel):
            self._advice = ddp_advice(self.model, self._unused)
            rank_zero_info("SoloDDP advice:\n" + "\n".join(f"  - {line}" for line in self._advice))

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Not DDPStrategy's rewrite of DDP's unused-parameter error: it names Lightning's strategies.
        self._watchdog.on_exception(exception)  # names a peer whose process ended (the error names none)
        if self._unused.phase is not Phase.USER:
            self._unused.stop()
        explain_exception(exception, self._unused)

    @override
    def teardown(self) -> None:
        self._rewrap_listeners = []  # also after an exception
        self._watchdog.teardown()
        if self._sigterm is not None:
            self._sigterm.uninstall()
            self._sigterm = None
        self._uneven.uninstall()
        self._resume.reset()
        self._compile.teardown()
        if not self._layer_sync_read:  # no fit's setup chose a SyncBN plugin: nothing to revert
            self._layer_sync_request, self._layer_sync = self._layer_sync, None
        super().teardown()  # unwraps DDP, reverts SyncBN with the plugin setup chose
        self._layer_sync, self._layer_sync_read = self._layer_sync_request, False  # the request, as found
        cpu_malloc.restore()  # the fit's malloc setting ends with it (lightning_solo.core.cpu_malloc)

    # ---------------------------------------------------------------------------------------------- helpers
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
    def _planned_steps(self) -> float | None:
        """The fit's optimizer steps as Lightning estimates them (``inf``: unbounded); None without a trainer."""
        trainer = self._attached_trainer
        return None if trainer is None else float(trainer.estimated_stepping_batches)

    @property
    def _attached_trainer(self) -> pl.Trainer | None:
        """The Trainer once the LightningModule is attached to one (Lightning's own tests run hooks without)."""
        return getattr(self.lightning_module, "_trainer", None)

    @property
    def _module(self) -> pl.LightningModule:
        if (module := self.lightning_module) is None:
            raise RuntimeError(
                "SoloDDP has no LightningModule yet: it is connected by Trainer.fit/validate/test"
            )
        return module

    @property
    def _wrapped(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("SoloDDP has no model yet: it is connected by Trainer.fit/validate/test")
        return self.model

    @property
    def _collective_timeout(self) -> timedelta:
        return self._timeout if self._timeout is not None else timedelta(minutes=30)
