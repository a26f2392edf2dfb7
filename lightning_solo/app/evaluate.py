"""The evaluation runner: ``python -m lightning_solo.evaluate ckpt=PATH|auto [ckpt_dir=DIR] [group=option ...]``.

``evaluate(cfg)`` is a plain function; ``main`` the thin Hydra wrapper over ``conf/evaluate.yaml``, which takes
the training groups (model, data, parallelism, trainer, logger, paths). It loads the checkpoint (``ckpt=auto``:
the newest in ``ckpt_dir`` that verifies, corrupt or half-written ones passed over), then runs ``stages``
(validate, test, predict) under SoloDDP on any number of processes: every sample evaluated exactly once
(:mod:`lightning_solo.ddp.eval`), the metrics equal to one process's, the sample count reported, and each
stage's predictions gathered to rank 0 in dataset order (``predictions_<stage>.csv`` in the run directory,
beside ``evaluation.json``).

Example::

    python -m lightning_solo.evaluate ckpt=auto ckpt_dir=outputs/train/2026-01-01_12-00-00
    python -m lightning_solo.evaluate ckpt=outputs/train/<run>/checkpoints/last.ckpt stages=[test,predict]
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import hydra
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig

from lightning_solo.app.config_check import ConfigError
from lightning_solo.app.run import (
    check_run_config,
    close_process_group,
    config_path,
    make_trainer,
    report_bad_input,
)
from lightning_solo.checkpoint.select import decide_resume
from lightning_solo.core.cluster import PreflightError
from lightning_solo.core.decision import Decision

STAGES = ("validate", "test", "predict")
# rank 0's choice for ckpt=auto, inherited by the ranks Lightning's popen launcher starts: they cannot pick another
_CHOSEN_ENV = "LIGHTNING_SOLO_EVAL_CKPT"


def decide_checkpoint(ckpt: str, ckpt_dir: str | None) -> Decision:
    """The checkpoint to evaluate: ``ckpt`` itself, or with ``ckpt="auto"`` the newest one in ``ckpt_dir`` (a
    checkpoints directory or a run directory holding ``checkpoints/``) that verifies. Raises ConfigError."""
    if ckpt != "auto":
        if not Path(ckpt).is_file():
            raise ConfigError(
                f"ckpt: no checkpoint file at {ckpt!r}; give a .ckpt path, or ckpt=auto ckpt_dir=DIR"
            )
        return Decision("checkpoint", str(ckpt), "given as ckpt")
    if not ckpt_dir:
        raise ConfigError(
            "ckpt=auto needs ckpt_dir=DIR: a run directory (outputs/train/<run>) or its checkpoints/"
        )
    directory = Path(ckpt_dir)
    if (directory / "checkpoints").is_dir():
        directory = directory / "checkpoints"
    if not directory.is_dir():
        raise ConfigError(f"ckpt_dir: no directory {ckpt_dir!r}")
    decision = decide_resume(directory)
    if decision.value is None:
        raise ConfigError(f"ckpt=auto: {decision.reason}")
    return Decision("checkpoint", decision.value, f"ckpt=auto: {decision.reason}")


def _checkpoint(cfg: DictConfig) -> tuple[Decision, bool]:
    chosen = os.environ.get(_CHOSEN_ENV)
    if cfg.ckpt == "auto" and chosen:
        return Decision("checkpoint", chosen, "ckpt=auto: the file rank 0 chose"), False
    decision = decide_checkpoint(str(cfg.ckpt), cfg.get("ckpt_dir"))
    if cfg.ckpt != "auto":
        return decision, False
    os.environ[_CHOSEN_ENV] = decision.value
    return decision, True


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate ``cfg.ckpt`` as configured; returns the metrics of every stage and, on rank 0, what was written."""
    from lightning_solo.callbacks.predictions import OrderedPredictions

    check_run_config(cfg)
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown or not cfg.stages:
        raise ConfigError(f"stages: expected a non-empty list of {', '.join(STAGES)}, got {list(cfg.stages)}")
    decision, chose = _checkpoint(cfg)
    try:
        rank_zero_info(f"evaluate: {decision}")
        datamodule = hydra.utils.instantiate(cfg.data)
        model = hydra.utils.instantiate(cfg.model)
        predictions = OrderedPredictions(filename=cfg.predictions) if cfg.get("predictions") else None
        trainer = make_trainer(cfg, [predictions] if predictions else [])
        metrics: dict[str, float] = {}
        ckpt_path = decision.value  # loaded by the first stage; the others evaluate the same weights
        for stage in cfg.stages:
            if stage == "predict":
                trainer.predict(model, datamodule=datamodule, ckpt_path=ckpt_path, return_predictions=False)
            else:
                results = getattr(trainer, stage)(model, datamodule=datamodule, ckpt_path=ckpt_path)
                metrics.update({k: float(v) for result in results for k, v in result.items()})
            ckpt_path = None
        report = _report(trainer, decision, metrics, predictions)
        close_process_group()
        return report
    finally:
        if chose:
            os.environ.pop(_CHOSEN_ENV, None)


def _report(trainer: Any, decision: Decision, metrics: dict[str, float], predictions: Any) -> dict[str, Any]:
    decisions = [d.as_dict() for k, d in trainer.strategy.decisions.items() if k.startswith("exact_eval")]
    report = {
        "checkpoint": decision.value,
        "world_size": trainer.world_size,
        "metrics": metrics,
        "decisions": [decision.as_dict(), *decisions],
    }
    if trainer.is_global_zero:
        if predictions is not None:
            report["predictions"] = {k: str(v) for k, v in predictions.written.items()}
            report["prediction_counts"] = dict(predictions.counts)
        path = Path(trainer.default_root_dir) / "evaluation.json"
        path.write_text(json.dumps(report, indent=2))
        rank_zero_info(f"evaluate: {json.dumps(metrics)} → {path}")
    return report


@hydra.main(version_base="1.3", config_path=config_path(), config_name="evaluate")
def main(cfg: DictConfig) -> float | None:
    try:
        report = evaluate(cfg)
    except (ConfigError, PreflightError) as err:
        report_bad_input(err)
    value = report["metrics"].get("val/acc", report["metrics"].get("test/acc"))
    return float(value) if value is not None else None


if __name__ == "__main__":
    main()
