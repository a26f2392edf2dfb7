"""SoloDDP: Lightning's DDPStrategy with defaults that are right for 1..N devices.

Example::

    import lightning as L
    from lightning_solo import SoloDDP

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP())   # or strategy="solo_ddp"
    trainer.fit(model, datamodule)
    print(trainer.strategy.decisions)        # what SoloDDP chose on your behalf, and why

This module is wiring only: each decision is made by a function in its own module and recorded as a
:class:`~lightning_solo.decision.Decision` in ``self.decisions`` for the run summary.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any, Literal

import lightning
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

from lightning_solo import comm, resume, syncbn
from lightning_solo import precision as amp
from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.advice import ddp_advice
from lightning_solo.checkpoint.io import SoloCheckpointIO, load_weights_only
from lightning_solo.checkpoint.manifest import read_manifest
from lightning_solo.checkpoint.select import checkpoint_dir, decide_resume
from lightning_solo.decision import Decision, DecisionLog
from lightning_solo.launcher import SoloLauncher, StartMethod, decide_start_method
from lightning_solo.preflight import gloo_interface_warning
from lightning_solo.unused import Phase, UnusedParameters
from lightning_solo.unused_sync import all_gather_grad_on
from lightning_solo.validate import check_number


# Lightning skips every restore step for a falsy checkpoint: "auto" that found nothing starts fresh.
class _NoCheckpoint(dict):
    def __bool__(self) -> bool:
        return False


_NO_CHECKPOINT = _NoCheckpoint({"pytorch-lightning_version": lightning.__version__})


class SoloDDP(DecisionLog, DDPStrategy):
    """DDP with sound defaults: ``gradient_as_bucket_view=True``, a launcher chosen by context,
    nccl on CUDA and gloo on CPU.

    Args:
        gradient_as_bucket_view: let gradients alias DDP's buckets (saves one copy of the gradients).
        find_unused_parameters: ``"auto"`` (default), ``True`` or ``False``. ``"auto"``: the first steps on
            ``True`` as evidence, then DDP's fast path if every parameter was used (parameters never used are
            named and excluded), else ``True``; ``True`` also whenever something communicates inside backward
            (SyncBN, ``all_gather(sync_grads=True)``). On the fast path a parameter that goes unused later is
            completed exactly as ``True`` would, then ``True``. Whatever the setting, DDP is re-wrapped when the
            set of trainable parameters changes (fine-tuning), so every trainable parameter is synchronised.
            See :mod:`lightning_solo.unused`. The end-of-fit advice from DDP's logging data is in ``self.advice``.
        start_method: ``"auto"`` (fork in notebooks, popen in scripts), or one of Lightning's launchers. With
            fork/spawn/forkserver, the notebook gets the fit's state back (true ``global_step``, callback state,
            decisions) and can fit again on the same Trainer: see :mod:`lightning_solo.launcher`.
        timeout: collective timeout, a ``timedelta`` or seconds.
        checkpoint_io: defaults to :class:`~lightning_solo.checkpoint.io.SoloCheckpointIO` (atomic, fsynced,
            manifest-verified files, ``weights_only=True`` loads). Every checkpoint also carries the training
            sampler's position and every rank's RNG states, so a mid-epoch resume continues exactly
            (:mod:`lightning_solo.resume`).
        sync_batchnorm: ``True``, ``False`` or ``"auto"``: synchronise BatchNorm statistics over the global
            batch with a backend-agnostic SyncBN (works on CPU/gloo), reverted to the original classes
            after fit. ``"auto"`` turns it on when there is BatchNorm, more than one process and a
            per-device batch below ``sync_batchnorm_threshold`` (see :func:`lightning_solo.syncbn.decide`).
            ``Trainer(sync_batchnorm=True)`` counts as ``True``.
        sync_batchnorm_threshold: per-device batch size below which ``"auto"`` synchronises.
        precision: ``"auto"``, ``"bf16-mixed"``, ``"16-mixed"`` (fp16 + GradScaler, real fp16 on CPU too),
            ``"32-true"``, or ``None`` to leave it to ``Trainer(precision=...)``. ``"auto"``: bf16 on GPUs that
            support it, fp16 on GPUs that don't, fp32 on CPU. A different explicit ``Trainer(precision=...)``
            raises ``ValueError`` (``"auto"`` defers to it; the Trainer's ``"32-true"`` counts as unset, being
            its default); see :func:`lightning_solo.precision.decide_precision`.
        scaler: GradScaler settings for 16-mixed: ``init_scale``, ``growth_factor`` (> 1), ``backoff_factor``
            (in (0, 1)), ``growth_interval`` (>= 1). On resume the saved scale is kept and these factors apply.
        skip_lr_on_overflow: hold step-interval LR schedulers on a step skipped for inf/nan gradients.
        comm_hook: gradient communication, registered on every device (gloo/CPU too, unlike Lightning):
            ``None`` (exact all-reduce), ``"fp16"``, ``"bf16"``, ``"powersgd"`` (its state is checkpointed and
            restored), or ``"post_local_sgd"`` (local steps, parameters averaged every ``local_sgd_period``
            steps after ``local_sgd_warmup`` synchronous ones; the model is averaged once more at the end of
            fit), or ``"auto"`` (each of exact, fp16, bf16, powersgd for a few steps, the fastest kept:
            :mod:`lightning_solo.comm.auto`). See :class:`lightning_solo.comm.CommHook`. Lightning's
            ``ddp_comm_hook=`` callables are also registered on every device.
        powersgd_rank: PowerSGD's matrix approximation rank.
        powersgd_start_iter: exact all-reduce steps before PowerSGD starts compressing (>= 2).
        local_sgd_period: post-local-SGD: steps between parameter averages.
        local_sgd_warmup: post-local-SGD: synchronous steps before local steps start.
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
        self._barrier_group = (
            None  # the monitored barrier's and unused-parameter evidence's group; None: world
        )
        self._barrier_made = False
        self._side_group: Any = None
        self._side_channel_made = False
        self._unused = unused
        self._decide(unused.decision)
        self.advice: list[str] = []

    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            return super()._configure_launcher()
        # fork/spawn/forkserver: the parent gets the fit's state back and can fit again (lightning_solo.launcher).
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

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the device, then the process group
        # Now that every rank can take part: settle the placeholder precision plugin ("auto" is agreed by all
        # ranks, a collective). Nothing uses the plugin before this.
        self.precision_plugin, decisions = amp.decide_precision_plugin(
            self.precision_plugin, self._precision_options, self.lightning_module.trainer, self.root_device
        )
        for decision in decisions:
            self._decide(decision)
        if self.root_device.type == "cpu":
            # Lightning's launchers already split the cores between local ranks; record what is in force.
            self._decide(
                Decision("cpu_threads", torch.get_num_threads(), "cores split between local processes")
            )
        self._decide(
            Decision("process_group_backend", self._process_group_backend, "nccl on CUDA, gloo otherwise")
        )
        # A group creation is a collective: once per process, and only with a live process group (none exists
        # when `init_process_group` is mocked, as in Lightning's own strategy tests); the next setup makes it.
        if not self._barrier_made and torch.distributed.is_available() and torch.distributed.is_initialized():
            if self.num_nodes > 1 and self._gloo_side_group and self.local_rank == 0:
                if warning := gloo_interface_warning():
                    warnings.warn(warning, stacklevel=2)
            # None (the plain barrier, evidence over the world) when gloo cannot be had in time, on every rank.
            self._barrier_group, decision = comm.barrier_group(
                self._timeout, side_group=self._gloo_side_group, device=self.root_device
            )
            self._barrier_made = True
            self._decide(decision)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # Made after setup, while restoring a checkpoint (e.g. the GradScaler kept across a resume).
        for decision in getattr(self.precision_plugin, "decisions", {}).values():
            self._decide(decision)

    # Exact mid-epoch resume (lightning_solo.resume): a resumable training loader, its position and every
    # rank's RNG as of the last optimizer step saved in each checkpoint (all ranks run save_checkpoint),
    # replayed after a restore.
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or not trainer.training:
            return dataloader
        dataloader, decision = resume.make_resumable(dataloader, seed=torch.initial_seed())
        self._decide(decision)
        self._train_loader = dataloader
        record, self._resume_record = getattr(self, "_resume_record", None), None
        if (planned := resume.decide(record, trainer, dataloader)) is not None:
            self._decide(planned)
        # Until the first step of this fit, "the last step" is where it starts (a validation before it, e.g. in
        # a replayed accumulation cycle, must leave the RNG there too).
        ready = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        self._last_step = (resume.saved_rng(record) or resume.rng_state(), ready)
        self._step_buffers = resume.step_buffers(trainer)
        return dataloader

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)
        self._comm.after_step(self.root_device)
        # The point a checkpoint's record describes, whenever the save happens before the next step.
        trainer = self.lightning_module.trainer
        self._last_step = (resume.rng_state(), int(trainer.fit_loop.epoch_loop.batch_progress.current.ready))
        self._step_buffers = resume.step_buffers(trainer)
        return output

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            resume.validation_neutral(getattr(self, "_last_step", None))

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None
    ) -> None:
        self.add_resume_state(checkpoint, filepath=filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def add_resume_state(
        self, checkpoint: dict[str, Any], collective: bool = True, filepath: Any = None
    ) -> None:
        """Put the resume record and the comm-hook state into ``checkpoint``. ``collective=False`` (the save
        on an exception, which must not wait on other ranks): this rank's record and hook state only."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            last_step = getattr(self, "_last_step", None)
            checkpoint[resume.RESUME_KEY] = resume.capture(
                trainer, getattr(self, "_train_loader", None), last_step, collective
            )
            # Inside an accumulation cycle the forwards since the step moved buffers (BatchNorm's running
            # statistics) that the resume replays: save them as of the step, like everything else.
            resume.rewind_buffers(checkpoint, trainer, last_step, getattr(self, "_step_buffers", None))
        # A full checkpoint. PowerSGD's state is a collective (rank 0 records every rank's shard): only with all.
        if "optimizer_states" in checkpoint and (collective or self._comm.name != "powersgd"):
            if hook_state := self._comm.state_dict(filepath):  # each rank writes its PowerSGD shard beside it
                checkpoint[comm.CHECKPOINT_KEY] = hook_state

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if os.fspath(checkpoint_path) == "auto":
            checkpoint_path = self._choose_auto_checkpoint()
            if checkpoint_path is None:
                return _NO_CHECKPOINT
            checkpoint = load_weights_only(
                checkpoint_path,
                map_location=lambda storage, loc: storage,
                weights_only=getattr(self.checkpoint_io, "weights_only", True)
                if weights_only is None
                else weights_only,
            )
        else:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume_record = checkpoint.get(resume.RESUME_KEY)
        # Applied when the hook is registered; each rank reads its own PowerSGD shard beside the checkpoint.
        self._comm.load_state_dict(checkpoint.get(comm.CHECKPOINT_KEY), checkpoint_path)
        return checkpoint

    def _choose_auto_checkpoint(self) -> str | None:
        """``fit(ckpt_path="auto")``: rank 0 picks the newest checkpoint in the checkpoint callback's directory
        that verifies (hashing it once) and broadcasts it; every rank checks it sees the same file."""
        trainer = self.lightning_module.trainer
        chosen = None
        if self.global_rank == 0:
            decision = decide_resume(checkpoint_dir(trainer))
            chosen = (decision, decision.value and read_manifest(decision.value))
        decision, manifest = self.broadcast(chosen, src=0)
        self._decide(decision)
        rank_zero_info(f"ckpt_path='auto': {decision}")
        if decision.value is not None and read_manifest(decision.value) != manifest:
            raise RuntimeError(
                f"rank {self.global_rank} does not see the checkpoint rank 0 chose for ckpt_path='auto'"
                f" ({decision.value}): put the checkpoint directory on a filesystem all nodes share"
            )
        lightning_compat.set_ckpt_path(trainer, decision.value)
        return decision.value

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only (a torch 1.8 limit, long gone): register on every device.
        if self._comm.name is None and self._ddp_comm_hook is not None:
            lightning_compat.register_ddp_comm_hook(  # self.model is DDP here
                self.model,
                self._ddp_comm_state,
                self._ddp_comm_hook,
                self._ddp_comm_wrapper,  # type: ignore[arg-type]
            )
            name = getattr(self._ddp_comm_hook, "__qualname__", repr(self._ddp_comm_hook))
            self._decide(Decision("comm_hook", name, "ddp_comm_hook given by the user"))
            return
        self._decide(self._comm.register(self.model, node=self.node_rank))  # type: ignore[arg-type]
        if self._comm.averaging_period is not None:
            # DDPStrategy.setup starts its PeriodicModelAverager when it sees a PostLocalSGDState.
            self._ddp_comm_state = self._comm.state
            self._model_averaging_period = self._comm.averaging_period

    @override
    def _enable_model_averaging(self) -> None:
        super()._enable_model_averaging()
        # Same schedule, averaging in place (keeps channels_last); restores its step count on resume.
        self._model_averager = self._comm.attach_averager(self._model_averager)  # type: ignore[arg-type]

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
        return self._unused.bind(super()._setup_model(model), self._side_channel())

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
            keep_grads=not self.lightning_module.automatic_optimization,
            exact_allreduce=self._comm.name is None and self._ddp_comm_hook is None,
        )
        self._register_ddp_hooks()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Strategy.backward, with the unused-parameter step right after backward and before on_after_backward:
        # a collective there (self.log(..., sync_dist=True), say) must not meet a bucket DDP still holds back.
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._unused.before_backward(self.model)
        self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args, **kwargs)
        self._unused.after_backward(self.model)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
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
        rewrap = self._unused.at_boundary(self.model)
        if self._comm.at_boundary(self.root_device) or rewrap:  # comm_hook="auto" between its trials
            self._rewrap()
        if self.decisions.get("find_unused_parameters") is not self._unused.decision:
            self._decide(self._unused.decision)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._unused.finish(self.model)
        self._decide(self._unused.decision)
        if isinstance(self.model, DistributedDataParallel):
            self.advice = ddp_advice(self.model, self._unused)
            rank_zero_info("SoloDDP advice:\n" + "\n".join(f"  - {line}" for line in self.advice))
        if self._model_averager is not None:
            # Post-local-SGD: between averages the ranks' models differ; end on their average, not rank 0's.
            self._comm.average_parameters(self.lightning_module)

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
            self._unused.explain(exception)

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        # A monitored barrier names the ranks that never arrived instead of hanging until the NCCL/gloo timeout.
        if self._barrier_group is None or not torch.distributed.is_initialized():
            return super().barrier(name, *args, **kwargs)
        comm.monitored_barrier(name, self._timeout, self._barrier_group)

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
