"""SoloLauncher: Lightning's fork/spawn launcher, with the fit's state brought back to the parent process.

With ``ddp_notebook`` (fork) or ``ddp_spawn``, training runs in worker processes and Lightning sends back
only rank 0's weights, the best checkpoint path, ``trainer.state`` and ``callback_metrics``. Everything
else stays behind in the workers: ``trainer.global_step`` and ``current_epoch`` read 0 in the notebook,
callbacks look untrained (no best score, an empty ``LearningRateMonitor.lrs``, a list your own callback
filled is empty), the strategy's decisions are missing, a second ``trainer.fit()`` on the same Trainer
raises ``NotImplementedError`` (Lightning #18775), and every fit leaves an empty temp directory behind.

SoloLauncher sends back, from local rank 0, after the fit:

* the fit loop's progress (so ``global_step``, ``current_epoch`` and the logging step are the true ones);
* every callback's data attributes (plain values, containers, tensors, dataclasses: what an in-process
  fit would have left there, e.g. ``ModelCheckpoint.best_model_score``, ``RunSummary.summary``,
  ``WarmupScaledLR.schedule``) and its ``state_dict()``, loaded with ``load_state_dict``;
* the public data attributes of the LightningModule (``self.losses = []`` that ``training_step`` appended to);
* the strategy's ``decisions`` and ``advice``, the logged and progress-bar metrics, the loggers' versions;
* the settled precision plugin with its GradScaler state, and the comm hook's state (PowerSGD's iteration
  and every rank's error feedback, post-local-SGD's counters), so a second fit continues them. The
  unused-parameter policy is the parent's own object, used by every fit's ranks as it is.

Objects that are not data (modules, optimizers, hooks, file handles, functions) are never copied: the
parent keeps its own. The weights are loaded onto the CPU, so the parent never touches CUDA and the next
fork stays possible. Because the parent now holds the first fit's state, a second ``fit`` on the same
Trainer continues the way it would in one process (new optimizers, like any second ``fit``; use
``ckpt_path=`` to resume the optimizer too), so Lightning's refusal is lifted.

Limits: only local rank 0 of the node the notebook runs on reports back (as in Lightning); objects held by
callbacks that are not data (a torchmetrics ``Metric``, an open writer) keep their parent-side state; a
second fit on the same Trainer with a ``CSVLogger`` starts its ``metrics.csv`` afresh, because the worker
creates the logger's writer anew and Lightning's writer clears an existing file (a new Trainer avoids it).

Example::

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP())   # in Jupyter: fork, SoloLauncher
    trainer.fit(model, datamodule)
    trainer.global_step, trainer.checkpoint_callback.best_model_score      # the workers' values
    trainer.fit_loop.max_epochs += 2
    trainer.fit(model, datamodule)                                          # two more epochs
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.core.checks import check_choice
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.carry import LEFT_BEHIND, pack, packed_attributes, unpack, unpack_attributes

_STATE_KEY = "lightning_solo_state"
_STRATEGY_ATTRIBUTES = ("decisions", "advice")


StartMethod = Literal["auto", "popen", "spawn", "fork", "forkserver"]
_START_METHODS = ("auto", "popen", "spawn", "fork", "forkserver")


def in_notebook() -> bool:
    """True inside IPython/Jupyter (or ``python -i``), where only a fork launcher can work."""
    return (
        hasattr(sys, "ps1") or bool(sys.flags.interactive) or ("IPython" in sys.modules and _ipython_active())
    )


def _ipython_active() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def decide_start_method(start_method: str) -> Decision:
    """``"auto"`` means fork inside a notebook (spawn and popen cannot work there) and popen elsewhere."""
    check_choice("start_method", start_method, _START_METHODS)
    if start_method != "auto":
        return Decision("start_method", start_method, "set by the user")
    if in_notebook():
        return Decision("start_method", "fork", "interactive session: only a fork launcher works here")
    return Decision("start_method", "popen", "script: each rank re-runs the command (Lightning's default)")


class SoloLauncher(lightning_compat.MultiProcessingLauncher):
    """The launcher ``SoloDDP`` uses for ``start_method`` ``"fork"``, ``"spawn"`` and ``"forkserver"``."""

    @override
    def launch(self, function: Any, *args: Any, trainer: L.Trainer | None = None, **kwargs: Any) -> Any:
        # Lightning refuses a second fit on one Trainer because its parent kept none of the first fit's
        # state; this parent keeps it (see the module docstring), so the second fit continues correctly.
        self._already_fit = False
        if self._start_method == "fork" and torch.cuda.is_initialized():
            raise RuntimeError(
                "SoloDDP forks its ranks here (a notebook), but this process has already initialised CUDA, so every"
                " rank would die with 'Cannot re-initialize CUDA in forked subprocess'. Restart the kernel and call"
                " trainer.fit() before anything touches CUDA (no .cuda()/.to('cuda'), no torch.cuda calls that"
                " allocate); the ranks move the model to their GPUs themselves."
            )
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: L.Trainer, results: Any) -> Any:
        # Every rank is here: the comm hook's state (PowerSGD gathers each rank's error feedback) is a collective.
        hooks = getattr(trainer.strategy, "_comm", None)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._comm_state = hooks.state_dict() if hooks is not None and fitting else None
        return super()._collect_rank_zero_results(trainer, results)

    @override
    def get_extra_results(self, trainer: L.Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        # Bytes (the queue's pickler would share tensors through memory that dies with this process), in a file:
        # Lightning's parent joins the workers before it reads the queue, so a result larger than the pipe's
        # buffer (64 KiB) would block rank 0 forever. Only the path goes through the queue, as for the weights.
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
        if trainer.checkpoint_callback and hasattr(trainer.checkpoint_callback, "best_model_path"):
            trainer.checkpoint_callback.best_model_path = str(worker_output.best_model_path)
        if worker_output.weights_path is not None:
            # map_location="cpu": a CUDA context in the parent would make the next fork unusable.
            weights = self._strategy.checkpoint_io.load_checkpoint(
                worker_output.weights_path, map_location="cpu"
            )
            # Non-strict as in Lightning: the worker may have added or removed layers.
            trainer.lightning_module.load_state_dict(weights, strict=False)
            # Lightning removes the file but leaks the mkdtemp() directory around it, one per fit.
            shutil.rmtree(os.path.dirname(worker_output.weights_path), ignore_errors=True)
        trainer.state = worker_output.trainer_state
        self.update_main_process_results(trainer, worker_output.extra)

    @override
    def update_main_process_results(self, trainer: L.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if _STATE_KEY in extra:
            path = extra[_STATE_KEY]
            try:
                with open(path, "rb") as file:
                    state = pickle.load(
                        file
                    )  # our own file, written by rank 0 just now: a structure of bytes
            finally:
                os.remove(path)
            restore(trainer, state)


def capture(trainer: L.Trainer) -> dict[str, Any]:
    """What rank 0 holds after the run that an in-process run would leave in the parent, packed: each value
    a pickled CPU copy on its own, so that one that cannot be unpickled in the parent loses only itself."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    connector = lightning_compat.logger_connector(trainer)
    return {
        "fit_loop": pack(trainer.fit_loop.state_dict()) if fitting else None,
        "callbacks": [
            (cb.state_key, packed_attributes(cb), pack(cb.state_dict())) for cb in trainer.callbacks
        ],
        "module": packed_attributes(trainer.lightning_module, public_only=True, skip=("training",)),
        "strategy": packed_attributes(trainer.strategy, only=_STRATEGY_ATTRIBUTES),
        "loggers": [
            packed_attributes(logger, only=lightning_compat.LOGGER_ATTRIBUTES) for logger in trainer.loggers
        ],
        **{
            name.lstrip("_"): pack(dict(getattr(connector, name)))
            for name in lightning_compat.LOGGER_CONNECTOR_METRICS
        },
    }


def _training_state(trainer: L.Trainer, launcher: SoloLauncher) -> dict[str, bytes | None]:
    """What the next fit continues from beyond the module: the settled precision plugin (a pickled GradScaler
    keeps its scale and growth tracker as numbers, no device tensors) and the comm hook's state."""
    try:
        plugin = pickle.dumps(trainer.strategy.precision_plugin)
    except Exception:
        plugin = None
    return {"precision_plugin": plugin, "comm_hook": pack(getattr(launcher, "_comm_state", None))}


def _restore_training_state(strategy: Any, state: dict[str, bytes | None]) -> None:
    if (plugin := unpack(state["precision_plugin"], "the precision plugin")) is not LEFT_BEHIND:
        strategy.precision_plugin = plugin
    hook_state = unpack(state["comm_hook"], "the comm hook's state")
    if hook_state not in (LEFT_BEHIND, None) and getattr(strategy, "_comm", None) is not None:
        strategy._comm.load_state_dict(
            hook_state
        )  # the next fit's ranks apply it when they register the hook


def restore(trainer: L.Trainer, state: dict[str, Any]) -> None:
    """Apply :func:`capture`'s result to the parent's trainer, callbacks, module, strategy and loggers."""
    if "training_state" in state:
        _restore_training_state(trainer.strategy, state["training_state"])
    fit_loop = unpack(state["fit_loop"], "the fit loop's progress")
    if fit_loop is not LEFT_BEHIND:
        _restore_progress(trainer.fit_loop, fit_loop)
        if (epoch_loop_state := fit_loop.get("epoch_loop.state_dict")) is not None:
            trainer.fit_loop.epoch_loop.on_load_checkpoint(epoch_loop_state)  # the logging step
    _restore_callbacks(trainer.callbacks, state["callbacks"])
    module = trainer.lightning_module
    owned = {*module._parameters, *module._buffers, *module._modules}
    attributes = unpack_attributes(state["module"], type(module).__name__)
    vars(module).update({k: v for k, v in attributes.items() if k not in owned})
    vars(trainer.strategy).update(unpack_attributes(state["strategy"], type(trainer.strategy).__name__))
    for logger, packed in zip(trainer.loggers, state["loggers"]):
        vars(logger).update(unpack_attributes(packed, type(logger).__name__))
    connector = lightning_compat.logger_connector(trainer)
    for name in ("logged_metrics", "progress_bar_metrics"):
        if (metrics := unpack(state[name], f"trainer.{name}")) is not LEFT_BEHIND:
            getattr(connector, f"_{name}").update(metrics)


def _restore_progress(loop: lightning_compat.Loop, state: dict[str, Any], prefix: str = "") -> None:
    # The progress counters only: `_Loop.load_state_dict` would also mark the loop as resuming from a
    # checkpoint, which the next fit would then act on.
    for name, value in vars(loop).items():
        if isinstance(value, lightning_compat.BaseProgress) and prefix + name in state:
            value.load_state_dict(state[prefix + name])
        elif isinstance(value, lightning_compat.Loop):
            _restore_progress(value, state, f"{prefix}{name}.")


def _restore_callbacks(callbacks: list[L.Callback], captured: list[tuple[str, dict, bytes | None]]) -> None:
    # Matched by state key (and order among equal keys): callbacks may reorder themselves during setup.
    pending: dict[str, list[tuple[dict, bytes | None]]] = {}
    for key, attributes, state_dict in captured:
        pending.setdefault(key, []).append((attributes, state_dict))
    for callback in callbacks:
        matches = pending.get(callback.state_key)
        if not matches:
            continue
        packed, packed_state = matches.pop(0)
        name = type(callback).__name__
        vars(callback).update(
            unpack_attributes(packed, name)
        )  # first: ModelCheckpoint reloads scores into its dirpath only
        state_dict = unpack(packed_state, f"{name}.state_dict()")
        if state_dict is LEFT_BEHIND or not state_dict:
            continue
        try:
            callback.load_state_dict(state_dict)
        except Exception as err:
            rank_zero_warn(
                f"{name}.load_state_dict() failed in the parent after the fit ({err!r}); "
                "its data attributes were restored"
            )
        # load_state_dict may stage a resume for the next fit (WarmupScaledLR does); an in-process fit
        # would have consumed it, so the worker's attributes have the last word.
        vars(callback).update(unpack_attributes(packed, name))
