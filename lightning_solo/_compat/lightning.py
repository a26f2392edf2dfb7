"""Private Lightning names the pack uses, one accessor each (checked on lightning 2.6.6), and those it overrides or
sets in its subclasses (:data:`OVERRIDDEN`, :data:`STRATEGY_ATTRIBUTES`), listed for tests/test_compat.py."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper, _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from lightning.pytorch.utilities.exceptions import _augment_message
from torch.utils.data import SequentialSampler

# Classes the pack subclasses or checks against (checked on lightning 2.6.6).
MultiProcessingLauncher = _MultiProcessingLauncher
WorkerOutput = _WorkerOutput
Loop = _Loop
BaseProgress = _BaseProgress
SubprocessScriptLauncher = _SubprocessScriptLauncher  # the popen launcher, which re-runs sys.argv

# Methods the pack overrides, and calls through super() (checked on lightning 2.6.6).
OVERRIDDEN: dict[type, tuple[str, ...]] = {
    DDPStrategy: ("_configure_launcher", "_register_ddp_hooks", "_setup_model", "_enable_model_averaging"),
    ModelParallelStrategy: ("_configure_launcher",),
    ModelCheckpoint: ("_save_last_checkpoint", "_remove_checkpoint", "_link_checkpoint"),
    _MultiProcessingLauncher: ("_recover_results_in_main_process", "_collect_rank_zero_results", "_wrapping_function"),
}
# DDPStrategy's attributes SoloDDP reads or sets, ``_layer_sync`` made a property (checked on lightning 2.6.6).
STRATEGY_ATTRIBUTES = ("_layer_sync", "_ddp_kwargs", "_start_method", "_launcher", "_timeout",
                       "_model_averaging_period", "_ddp_comm_state", "_ddp_comm_hook", "_ddp_comm_wrapper",
                       "_model_averager")  # fmt: skip
# Logger attributes a notebook parent takes back from the worker (checked on lightning 2.6.6).
LOGGER_ATTRIBUTES = ("_version",)
# Functions used as they are (checked on lightning 2.6.6).
register_ddp_comm_hook = _register_ddp_comm_hook
augment_message = _augment_message
is_local_path = _is_local_file_protocol


def fit_data_source(trainer: Any) -> Any:
    """What was passed to ``fit`` as data: ``trainer.fit_loop._data_source.instance`` (checked on lightning 2.6.6)."""
    return getattr(getattr(trainer.fit_loop, "_data_source", None), "instance", None)


def combined_loader_mode(trainer: Any) -> str | None:
    """How Lightning combines the training loaders: ``fit_loop._combined_loader._mode`` (checked on lightning 2.6.6)."""
    return getattr(getattr(trainer.fit_loop, "_combined_loader", None), "_mode", None)


def precision_flags(trainer: Any, default: str) -> tuple[str, Any]:
    """``Trainer(precision=...)`` and its precision plugin: ``_accelerator_connector._precision_flag`` /
    ``._precision_plugin_flag`` (checked on lightning 2.6.6); ``default`` and ``None`` on a trainer without them."""
    connector = getattr(trainer, "_accelerator_connector", None)
    return getattr(connector, "_precision_flag", default), getattr(connector, "_precision_plugin_flag", None)


def set_ckpt_path(trainer: Any, path: str | None) -> None:
    """The checkpoint the fit restores: ``trainer._checkpoint_connector._ckpt_path`` (checked on lightning 2.6.6)."""
    trainer._checkpoint_connector._ckpt_path = path


def dump_checkpoint(trainer: Any, weights_only: bool) -> dict[str, Any]:
    """``trainer._checkpoint_connector.dump_checkpoint`` (checked on lightning 2.6.6)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only)


def logger_connector(trainer: Any) -> Any:
    """``trainer._logger_connector``: a notebook takes back its :data:`LOGGER_CONNECTOR_METRICS` (checked on 2.6.6)."""
    return trainer._logger_connector


LOGGER_CONNECTOR_METRICS = ("_logged_metrics", "_progress_bar_metrics")


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or None: ``LightningModule._trainer`` (checked on lightning 2.6.6)."""
    return module._trainer


def should_update_logs(trainer: Any) -> bool:
    """Whether loggers write this batch: ``trainer._logger_connector.should_update_logs`` (checked on 2.6.6)."""
    return bool(trainer._logger_connector.should_update_logs)


def inner_batch_sampler(batch_sampler: Any) -> Any:
    """The batch sampler in ``_IndexBatchSamplerWrapper``, or ``batch_sampler`` itself (checked on lightning 2.6.6)."""
    if isinstance(batch_sampler, _IndexBatchSamplerWrapper):
        return batch_sampler._batch_sampler
    return batch_sampler


def dataloader_init_args(dataloader: Any, sampler: Any = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments that re-create ``dataloader`` around ``sampler`` (else a placeholder to replace):
    ``_get_dataloader_init_args_and_kwargs`` (checked on lightning 2.6.6)."""
    return _get_dataloader_init_args_and_kwargs(
        dataloader, sampler if sampler is not None else SequentialSampler(range(0))
    )


def reinstantiate(dataloader: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``lightning.pytorch.utilities.data._reinstantiate_wrapped_cls`` (checked on lightning 2.6.6)."""
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def lightning_owns_requeue_signal(trainer: Any, signum: int) -> bool:
    """Whether ``signum``'s handler is Lightning's SLURM auto-requeue one: a ``_HandlersCompose`` holding
    ``trainer._signal_connector._slurm_sigusr_handler_fn`` (checked on lightning 2.6.6)."""
    import signal

    ours = getattr(getattr(trainer, "_signal_connector", None), "_slurm_sigusr_handler_fn", None)
    return ours is not None and ours in getattr(signal.getsignal(signum), "signal_handlers", ())


def hpc_save_path(trainer: Any) -> str:
    """The next ``hpc_ckpt_<n>.ckpt``: ``trainer._checkpoint_connector.hpc_save_path`` (checked on lightning 2.6.6)."""
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def compiled_by_user(module: Any) -> bool:
    """Whether ``module`` came from ``fit(torch.compile(model))``: its ``_compiler_ctx`` (checked on 2.6.6)."""
    return getattr(module, "_compiler_ctx", None) is not None


def logged_sample_count(frame: Any, tensor: Any) -> bool:
    """Whether ``tensor``, reduced from ``frame``, is ``_ResultMetric.compute``'s ``cumulated_batch_size`` (a
    ``sync_dist`` epoch mean's sample count; checked on lightning 2.6.6)."""
    return (
        frame is not None
        and frame.f_code is _ResultMetric.compute.__code__
        and getattr(frame.f_locals.get("self"), "cumulated_batch_size", None) is tensor
    )


def hook_call_codes() -> frozenset[Any]:
    """The code objects of ``trainer.call``'s ``_call_callback_hooks``, ``_call_lightning_module_hook`` and
    ``_call_strategy_hook``, whose frames hold the hook's name as ``hook_name`` (checked on lightning 2.6.6)."""
    from lightning.pytorch.trainer import call

    functions = (call._call_callback_hooks, call._call_lightning_module_hook, call._call_strategy_hook)
    return frozenset(f.__code__ for f in functions)
