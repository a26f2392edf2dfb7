"""SoloDDP: Lightning's DDPStrategy with defaults that are right for 1..N devices.

Example::

    import lightning as L
    from lightning_solo.ddp.strategy import SoloDDP

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP())   # or strategy="solo_ddp"
    trainer.fit(model, datamodule)
    print(trainer.strategy.decisions)        # what SoloDDP chose on your behalf, and why

This module is wiring only: each decision is made by a function in its own module and recorded as a
:class:`~lightning_solo.core.decision.Decision` in ``self.decisions`` for the run summary. The exact-resume hooks
are in :mod:`.resume_hooks`, the unused-parameter hooks in :mod:`.unused_hooks`, the exact-evaluation hooks in
:mod:`.eval_hooks`, the gradient-communication hooks in :mod:`.comm_hooks`.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_solo.checkpoint.io import SoloCheckpointIO
from lightning_solo.core import cluster, cpu_malloc
from lightning_solo.core.checks import check_bool, check_number
from lightning_solo.core.cluster import gloo_interface_warning
from lightning_solo.core.decision import Decision
from lightning_solo.ddp import comm, syncbn
from lightning_solo.ddp import precision as amp
from lightning_solo.ddp._comm_hooks import GradientCommHooks
from lightning_solo.ddp._eval_hooks import ExactEvalHooks
from lightning_solo.ddp._resume_hooks import ExactResumeHooks
from lightning_solo.ddp._unused_hooks import UnusedParameterHooks
from lightning_solo.ddp.advice import ddp_advice
from lightning_solo.ddp.launcher import SoloLauncher, StartMethod, decide_start_method
from lightning_solo.ddp.sigterm import SigtermAgreement
from lightning_solo.ddp.unused.policy import Phase, UnusedParameters


class SoloDDP(UnusedParameterHooks, ExactResumeHooks, ExactEvalHooks, GradientCommHooks):
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
        powersgd_rank: PowerSGD's matrix approximation rank.
        powersgd_start_iter: exact all-reduce steps before PowerSGD starts compressing (>= 2).
        local_sgd_period: post-local-SGD: steps between parameter averages.
        local_sgd_warmup: post-local-SGD: synchronous steps before local steps start.
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
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 1000,
        local_sgd_period: int = 4,
        local_sgd_warmup: int = 100,
        gloo_side_group: bool = True,
        exact_eval: bool = True,
        exact_resume: bool = True,
        cpu_malloc_reuse: bool = True,
        sigterm_agreement: bool = True,
        sigterm_checkpoint: bool = True,
        **ddp_kwargs: Any,
    ) -> None:
        launcher = decide_start_method(start_method)
        unused = UnusedParameters(find_unused_parameters, static_graph=bool(ddp_kwargs.get("static_graph")))
        comm.check_bucket_cap_mb(ddp_kwargs.get("bucket_cap_mb"))
        user_state = ddp_kwargs.get("ddp_comm_state")
        if unused.phase is Phase.WINDOW and type(user_state) is PowerSGDState:
            raise ValueError(
                "torch's PowerSGDState keys its error feedback to DDP's bucket layout, which changes when "
                "find_unused_parameters='auto' re-wraps DDP: use SoloDDP(comm_hook='powersgd') (the same "
                "algorithm, carried across re-wraps and checkpoints), or set find_unused_parameters=True/False"
            )
        comm_hooks = comm.make_comm_hook(
            comm_hook,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
            local_sgd_period=local_sgd_period,
            local_sgd_warmup=local_sgd_warmup,
        )
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
        self._sync_batchnorm = sync_batchnorm
        self._sync_batchnorm_threshold = sync_batchnorm_threshold
        self._precision_options = precision_options
        self._comm = comm_hooks
        self._gloo_side_group = bool(gloo_side_group)
        self._exact_eval = bool(exact_eval)
        self._exact_resume = check_bool("exact_resume", exact_resume)
        self._cpu_malloc_reuse = check_bool("cpu_malloc_reuse", cpu_malloc_reuse)
        self._sigterm_agreement = check_bool("sigterm_agreement", sigterm_agreement)
        self._sigterm_checkpoint = check_bool("sigterm_checkpoint", sigterm_checkpoint)
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
        self._barrier_group = None  # the monitored barrier's and the side channel's group; None: world
        self._barrier_made = False
        self._unused = unused
        self._decide(unused.decision)
        self.advice: list[str] = []

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

    # Lightning's connector assigns Trainer(sync_batchnorm=...)'s plugin, or None, to `_layer_sync`
    # unconditionally, and its TorchSyncBatchNorm fails on CPU: keep the request, and give
    # DDPStrategy.setup/teardown the plugin chosen in `setup` instead.
    @property
    def _layer_sync(self):
        return getattr(self, "_solo_layer_sync", None)

    @_layer_sync.setter
    def _layer_sync(self, plugin) -> None:
        self._requested_layer_sync = plugin

    @override
    def setup(self, trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            decision, self._solo_layer_sync = syncbn.decide_layer_sync(
                trainer, self._sync_batchnorm, self._sync_batchnorm_threshold, self._requested_layer_sync
            )
            self._decide(decision)
            # Every fit decides from its own evidence (a second fit in a notebook, another datamodule...).
            self._unused = self._unused.fresh()
            self._ddp_kwargs["find_unused_parameters"] = self._unused.initial
            self._decide(self._unused.decision)
        super().setup(trainer)  # converts SyncBN (when fitting), then wraps in DDP
        if trainer.state.fn == TrainerFn.FITTING:
            # Before Lightning registers its signal handlers. Every rank alike: the side channel is made once.
            group = self._side_channel() if self._sigterm_agreement and self.world_size > 1 else None
            if not self._sigterm_agreement:
                self._decide(Decision("sigterm_check", "lightning", "sigterm_agreement=False: as stock"))
            elif self.world_size == 1 or group is not None:
                self._sigterm = SigtermAgreement(group, checkpoint=self._sigterm_checkpoint)
                self._decide(self._sigterm.install(trainer))
                self._decide(self._sigterm.checkpoint_decision())
            else:
                self._decide(
                    Decision("sigterm_check", "lightning", "no gloo group: Lightning's per-batch broadcast")
                )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the device, then the process group
        if (launched := cluster.decide_external_launch(self.cluster_environment)) is not None:
            self._decide(
                launched
            )  # torchrun / SLURM started the processes, not the start method chosen above
        # Now that every rank can take part: settle the placeholder precision plugin ("auto" is agreed by all
        # ranks, a collective). Nothing uses the plugin before this.
        # Lightning's own tests call this without a LightningModule: Trainer(precision=...) is then unknown.
        trainer = getattr(self.lightning_module, "_trainer", None)
        self.precision_plugin, decisions = amp.decide_precision_plugin(
            self.precision_plugin, self._precision_options, trainer, self.root_device
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
        # A group creation is a collective: once per process, and only with a live process group (none exists
        # when `init_process_group` is mocked, as in Lightning's own strategy tests); the next setup makes it.
        if not self._barrier_made and torch.distributed.is_available() and torch.distributed.is_initialized():
            if self.num_nodes > 1 and self._gloo_side_group and self.local_rank == 0:
                if warning := gloo_interface_warning():
                    warnings.warn(warning, stacklevel=2)
            # None (the plain barrier, evidence over the world) when gloo cannot be had in time, on every rank.
            self._barrier_group, decision = comm.barrier_group(
                self.collective_timeout, side_group=self._gloo_side_group, device=self.root_device
            )
            self._barrier_made = True
            self._decide(decision)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # Made after setup, while restoring a checkpoint (e.g. the GradScaler kept across a resume).
        for decision in getattr(self.precision_plugin, "decisions", {}).values():
            self._decide(decision)

    _sigterm: SigtermAgreement | None = None

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        # Its workers leave a SIGTERM that is not their rank's to the ranks (lightning_solo.ddp.sigterm).
        return self._sigterm.shield_workers(dataloader) if self._sigterm is not None else dataloader

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._sigterm is not None:
            self._sigterm.close()
        self._unused.finish(self.wrapped)
        self._decide(self._unused.decision)
        if isinstance(self.model, DistributedDataParallel):
            self.advice = ddp_advice(self.model, self._unused)
            rank_zero_info("SoloDDP advice:\n" + "\n".join(f"  - {line}" for line in self.advice))

    @override
    def teardown(self) -> None:
        if self._sigterm is not None:
            self._sigterm.uninstall()
            self._sigterm = None
        super().teardown()
        cpu_malloc.restore()  # the fit's malloc setting ends with it (lightning_solo.core.cpu_malloc)

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        # A monitored barrier names the ranks that never arrived instead of hanging until the NCCL/gloo timeout.
        if self._barrier_group is None or not torch.distributed.is_initialized():
            return super().barrier(name, *args, **kwargs)
        comm.monitored_barrier(name, self.collective_timeout, self._barrier_group)

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
