"""SoloLauncher: Lightning's fork/spawn launcher, with the fit's state brought back to the parent process, which
can fit again. See docs/notebooks.md."""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from typing import Any, Literal, NamedTuple, Protocol, get_args, runtime_checkable

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.core import openmp
from lightning_solo.core.checks import check_choice
from lightning_solo.core.decision import Decision, DecisionLog
from lightning_solo.ddp.carry import LEFT_BEHIND, pack, unpack
from lightning_solo.ddp.precision.plugin import SoloMixedPrecision


@runtime_checkable
class _Carried(Protocol):
    """SoloDDP's seams a notebook's parent takes the fit's state back through (without importing the strategy,
    which imports this module)."""

    comm_hook: Any
    decisions: dict[str, Decision]
    advice: list[str]


_STATE_KEY = "lightning_solo_state"


StartMethod = Literal["auto", "popen", "spawn", "fork", "forkserver"]


class _Stopped(NamedTuple):
    """Rank 0's result when its function ended with ``exception`` (``SystemExit``, such as Lightning's
    ``SIGTERMException``, or ``KeyboardInterrupt``): the process exits with status 0 and puts no result, and the
    parent would wait for one for ever. The parent raises it."""

    exception: BaseException


def in_notebook() -> bool:
    """True inside IPython/Jupyter (or ``python -i``), where only a fork launcher can work."""
    ipython = sys.modules.get("IPython")
    return (
        hasattr(sys, "ps1")
        or bool(sys.flags.interactive)
        or getattr(ipython, "get_ipython", lambda: None)() is not None
    )


def decide_start_method(start_method: str) -> Decision:
    """``"auto"`` means fork inside a notebook (spawn and popen cannot work there) and popen elsewhere."""
    check_choice("start_method", start_method, get_args(StartMethod))
    if start_method != "auto":
        return Decision("start_method", start_method, "set by the user")
    if in_notebook():
        return Decision("start_method", "fork", "interactive session: only a fork launcher works here")
    return Decision("start_method", "popen", "script: each rank re-runs the command (Lightning's default)")


class SoloLauncher(lightning_compat.MultiProcessingLauncher):
    """The launcher ``SoloDDP`` uses for ``start_method`` ``"fork"``, ``"spawn"`` and ``"forkserver"``."""

    @override
    def launch(self, function: Any, *args: Any, trainer: L.Trainer | None = None, **kwargs: Any) -> Any:
        self._already_fit = False  # Lightning refuses a second fit: its parent kept no state; this one does
        if self._start_method == "fork":
            if torch.cuda.is_initialized():
                raise RuntimeError(
                    "SoloDDP forks its ranks here (a notebook), but this process has already initialised CUDA, so "
                    "every rank would die with 'Cannot re-initialize CUDA in forked subprocess'. Restart the kernel and "
                    "call trainer.fit() before anything touches CUDA (no .cuda()/.to('cuda'), no torch.cuda calls that "
                    "allocate); the ranks move the model to their GPUs themselves."
                )
            openmp.release_thread_pool()  # a forked rank would hang at its first parallel op (core/openmp.py)
        # The last fit's processes, joined: a rank forked with them would signal them (Lightning's SIGTERM handler
        # passes the signal on) and fail there ("can only test a child process").
        self.procs = []
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _wrapping_function(
        self, process_idx: int, trainer: Any, function: Any, args: Any, kwargs: Any, return_queue: Any, *rest: Any
    ) -> None:
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, *rest)
        except (SystemExit, KeyboardInterrupt) as stop:  # may end with status 0 and no result: tell the parent
            if process_idx == 0:
                return_queue.put(_Stopped(stop))
            raise

    @override
    def _collect_rank_zero_results(self, trainer: L.Trainer, results: Any) -> Any:
        # Every rank is here: the comm hook's state (PowerSGD gathers each rank's error feedback) is a collective.
        self._comm_state: dict[str, Any] | None = None
        if trainer.state.fn == TrainerFn.FITTING and isinstance(trainer.strategy, _Carried):
            self._comm_state = trainer.strategy.comm_hook.state_dict()
        return super()._collect_rank_zero_results(trainer, results)

    @override
    def get_extra_results(self, trainer: L.Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        # Bytes in a file (the queue's pickler would share tensors through memory that dies with this process, and a
        # result over the pipe's 64 KiB would block rank 0: the parent joins before it reads); its path in the queue.
        state = pickle.dumps({**capture(trainer), "training_state": _training_state(trainer, self)})
        fd, path = tempfile.mkstemp(prefix="lightning_solo_state_", suffix=".pkl")
        with os.fdopen(fd, "wb") as file:
            file.write(state)
        extra[_STATE_KEY] = path
        return extra

    @override
    def _recover_results_in_main_process(
        self, worker_output: lightning_compat.WorkerOutput, trainer: L.Trainer
    ) -> None:
        if isinstance(worker_output, _Stopped):  # e.g. a SIGTERM stop: the fit raises, as in rank 0's process
            raise worker_output.exception
        if trainer.checkpoint_callback and hasattr(trainer.checkpoint_callback, "best_model_path"):
            trainer.checkpoint_callback.best_model_path = str(worker_output.best_model_path)
        if worker_output.weights_path is not None:
            # map_location="cpu": a CUDA context in the parent would make the next fork unusable.
            weights = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path, map_location="cpu")
            # Non-strict as in Lightning: the worker may have added or removed layers.
            trainer.lightning_module.load_state_dict(weights, strict=False)
            # Lightning removes the file but leaks the mkdtemp() directory around it, one per fit.
            shutil.rmtree(os.path.dirname(worker_output.weights_path), ignore_errors=True)
        trainer.state = worker_output.trainer_state
        self.update_main_process_results(trainer, worker_output.extra)

    @override
    def update_main_process_results(self, trainer: L.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        path = extra[_STATE_KEY]
        try:
            with open(path, "rb") as file:
                state = pickle.load(file)  # our own file, written by rank 0 just now: a structure of bytes
        finally:
            os.remove(path)
        restore(trainer, state)


def capture(trainer: L.Trainer) -> dict[str, Any]:
    """What rank 0 holds after the run that an in-process run would leave in the parent, each value packed on its
    own (plain CPU data), so that one that cannot come back loses only itself."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    connector = lightning_compat.logger_connector(trainer)
    optimizers = trainer.optimizers if fitting else []
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs] if fitting else []
    carried = ("decisions", "advice") if isinstance(trainer.strategy, _Carried) else ()  # what it decided, advised
    return {
        "fit_loop": pack(trainer.fit_loop.state_dict(), "the fit loop's progress") if fitting else None,
        "callbacks": [
            (
                cb.state_key,
                pack(_state_dict(cb), f"{type(cb).__name__}.state_dict()"),
                pack(cb.decisions if isinstance(cb, DecisionLog) else None, f"{type(cb).__name__}.decisions"),
            )
            for cb in trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        ],
        "optimizers": [pack(opt.state_dict(), f"optimizer {i}.state_dict()") for i, opt in enumerate(optimizers)],
        "lr_schedulers": [pack(s.state_dict(), f"lr scheduler {i}.state_dict()") for i, s in enumerate(schedulers)],
        "strategy": {name: pack(getattr(trainer.strategy, name), f"strategy.{name}") for name in carried},
        "loggers": [
            {name: pack(getattr(logger, name, None), f"logger.{name}") for name in lightning_compat.LOGGER_ATTRIBUTES}
            for logger in trainer.loggers
        ],
        **{
            name.lstrip("_"): pack(dict(getattr(connector, name)), f"trainer.{name.lstrip('_')}")
            for name in lightning_compat.LOGGER_CONNECTOR_METRICS
        },
    }


def _state_dict(obj: Any) -> Any:
    try:
        return obj.state_dict()
    except Exception as err:  # noqa: BLE001 - a callback's failing state_dict loses only itself
        return err  # not data: pack() leaves it behind


def _training_state(trainer: L.Trainer, launcher: SoloLauncher) -> dict[str, bytes | None]:
    """What the next fit continues from beyond the module: the precision plugin's checkpoint state and the
    settings it was built from, and the comm hook's state."""
    precision: Any
    try:
        precision = _precision_state(trainer.strategy.precision_plugin)
    except Exception as err:  # noqa: BLE001 - a plugin that cannot say its state: the next fit settles its own
        precision = err  # not data: pack() leaves it behind
    return {
        "precision_plugin": pack(precision, "the precision plugin's state"),
        "comm_hook": pack(getattr(launcher, "_comm_state", None), "the comm hook's state"),
    }


def _precision_state(plugin: Precision) -> dict[str, Any]:
    """The settled plugin as Lightning checkpoints it (``state_dict()`` under its class name, then its
    ``on_save_checkpoint``), with its class and, for :class:`SoloMixedPrecision`, the settings to rebuild it."""
    checkpoint: dict[str, Any] = {}
    if state := plugin.state_dict():
        checkpoint[type(plugin).__qualname__] = state
    plugin.on_save_checkpoint(checkpoint)
    settings = None
    if isinstance(plugin, SoloMixedPrecision):
        settings = {
            "precision": plugin.precision,
            "device": plugin.device,
            "scaler": plugin.scaler_settings or None,
            "skip_lr_on_overflow": plugin.skip_lr_on_overflow,
        }
    return {"class": type(plugin).__qualname__, "settings": settings, "checkpoint": checkpoint}


def _settled_precision(current: Precision, carried: dict[str, Any]) -> Precision:
    """The parent's plugin for the next fit: its own when the worker kept that kind (the user's plugin, or one an
    earlier fit settled), else the kind the worker settled on, built here from plain settings; then the worker's
    checkpoint state loaded into it, as Lightning restores a plugin from a checkpoint."""
    kind, checkpoint = carried["class"], carried["checkpoint"]
    if type(current).__qualname__ == kind:
        plugin = current
    elif kind == SoloMixedPrecision.__qualname__ and carried["settings"]:
        plugin = SoloMixedPrecision(**carried["settings"])
    elif kind == Precision.__qualname__:
        plugin = Precision()
    else:
        rank_zero_warn(
            f"the worker's precision plugin {kind} cannot be rebuilt in the parent; the next fit settles its own"
        )
        return current
    plugin.on_load_checkpoint(checkpoint)
    if type(plugin).__qualname__ in checkpoint:
        plugin.load_state_dict(checkpoint[type(plugin).__qualname__])
    return plugin


def _restore_training_state(strategy: Any, state: dict[str, bytes | None]) -> None:
    if (carried := unpack(state["precision_plugin"], "the precision plugin's state")) is not LEFT_BEHIND:
        strategy.precision_plugin = _settled_precision(strategy.precision_plugin, carried)
    hook_state = unpack(state["comm_hook"], "the comm hook's state")
    if hook_state not in (LEFT_BEHIND, None) and isinstance(strategy, _Carried):
        # The next fit's ranks apply it when they register the hook.
        strategy.comm_hook.load_state_dict(hook_state)


def restore(trainer: L.Trainer, state: dict[str, Any]) -> None:
    """Apply :func:`capture`'s result to the parent's trainer, callbacks, optimizers, strategy and loggers."""
    if "training_state" in state:
        _restore_training_state(trainer.strategy, state["training_state"])
    fit_loop = unpack(state["fit_loop"], "the fit loop's progress")
    if fit_loop is not LEFT_BEHIND:
        _restore_progress(trainer.fit_loop, fit_loop)
        if (epoch_loop_state := fit_loop.get("epoch_loop.state_dict")) is not None:
            trainer.fit_loop.epoch_loop.on_load_checkpoint(epoch_loop_state)  # the logging step
    _restore_callbacks(trainer.callbacks, state["callbacks"])  # type: ignore[attr-defined]
    if state.get("optimizers"):
        _restore_optimizers(trainer, state["optimizers"], state["lr_schedulers"])
    if isinstance(trainer.strategy, _Carried):
        for name, blob in state["strategy"].items():
            if (value := unpack(blob, f"strategy.{name}")) is not LEFT_BEHIND:
                setattr(trainer.strategy, name, value)
    for logger, packed in zip(trainer.loggers, state["loggers"]):
        for name, blob in packed.items():
            if (value := unpack(blob, f"{type(logger).__name__}.{name}")) is not LEFT_BEHIND:
                setattr(logger, name, value)  # lightning_compat.LOGGER_ATTRIBUTES: the version
    connector = lightning_compat.logger_connector(trainer)
    for name in ("logged_metrics", "progress_bar_metrics"):
        if (metrics := unpack(state[name], f"trainer.{name}")) is not LEFT_BEHIND:
            getattr(connector, f"_{name}").update(metrics)


def _restore_optimizers(trainer: L.Trainer, optimizers: list[bytes | None], schedulers: list[bytes | None]) -> None:
    """The parent's own optimizers and schedulers (``configure_optimizers`` on its module, as the fit ran it),
    holding the worker's state: ``trainer.optimizers`` reads as after a fit in one process. A next ``fit`` makes
    new ones, as in one process."""
    module = trainer.lightning_module
    attached = lightning_compat.attached_trainer(module)  # the parent never ran the fit: attach it meanwhile
    try:
        module.trainer = trainer
        trainer.strategy.setup_optimizers(trainer)
    except Exception as err:  # noqa: BLE001 - e.g. configure_optimizers reading what only the workers had
        rank_zero_warn(
            f"the optimizers' state stays in the worker processes: configure_optimizers failed here ({err!r})"
        )
        return
    finally:
        module.trainer = attached
    pairs: list[tuple[Any, bytes | None]] = [
        *zip(trainer.optimizers, optimizers),
        *zip((c.scheduler for c in trainer.lr_scheduler_configs), schedulers),
    ]
    try:
        for owner, blob in pairs:
            if (state := unpack(blob, f"{type(owner).__name__}.state_dict()")) is not LEFT_BEHIND:
                owner.load_state_dict(state)
    except Exception as err:  # noqa: BLE001 - e.g. param groups a callback added during the fit (BackboneFinetuning)
        rank_zero_warn(f"the optimizers' state stays in the worker processes: it does not load here ({err!r})")
        trainer.strategy.optimizers = []  # none, rather than fresh ones
        trainer.strategy.lr_scheduler_configs = []


def _restore_progress(loop: lightning_compat.Loop, state: dict[str, Any], prefix: str = "") -> None:
    # The progress counters only: `_Loop.load_state_dict` would also mark the loop as resuming from a
    # checkpoint, which the next fit would then act on.
    for name, value in vars(loop).items():
        if isinstance(value, lightning_compat.BaseProgress) and prefix + name in state:
            value.load_state_dict(state[prefix + name])
        elif isinstance(value, lightning_compat.Loop):
            _restore_progress(value, state, f"{prefix}{name}.")


def _restore_callbacks(callbacks: list[L.Callback], captured: list[tuple[str, bytes | None, bytes | None]]) -> None:
    # Matched by state key (and order among equal keys): callbacks may reorder themselves during setup.
    pending: dict[str, list[tuple[bytes | None, bytes | None]]] = {}
    for key, state_dict, decisions in captured:
        pending.setdefault(key, []).append((state_dict, decisions))
    for callback in callbacks:
        matches = pending.get(callback.state_key)
        if not matches:
            continue
        packed_state, packed_decisions = matches.pop(0)
        name = type(callback).__name__
        state_dict = unpack(packed_state, f"{name}.state_dict()")
        if state_dict is not LEFT_BEHIND and state_dict:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                # The directory the fit resolved in its setup (which ran in the workers): ModelCheckpoint reloads
                # its scores only into the directory they were saved from.
                callback.dirpath = state_dict.get("dirpath")
            try:
                callback.load_state_dict(state_dict)
            except Exception as err:  # noqa: BLE001 - the user's callback: warn, go on with the others
                rank_zero_warn(f"{name}.load_state_dict() failed in the parent after the fit ({err!r})")
        decisions = unpack(packed_decisions, f"{name}.decisions")
        if isinstance(callback, DecisionLog) and isinstance(decisions, dict):
            callback.decisions.update(decisions)  # quietly: announced where they were made
