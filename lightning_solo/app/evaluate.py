"""The evaluation runner: ``python -m lightning_solo.evaluate ckpt=PATH|auto [ckpt_dir=DIR] [group=option ...]``.
See docs/evaluation.md and docs/runner.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_solo.app.config_check import ConfigError, check_config
from lightning_solo.app.run import check_run_config, close_process_group, hydra_command, make_trainer, task_overrides
from lightning_solo.core.decision import Decision

STAGES = ("validate", "test", "predict")
#: What a checkpoint was trained with, taken from its run's config; everything else is this command's.
RUN_GROUPS = ("model", "data")
# rank 0's choice for ckpt=auto, inherited by the ranks Lightning's popen launcher starts: they cannot pick another
_CHOSEN_ENV = "LIGHTNING_SOLO_EVAL_CKPT"


def decide_checkpoint(ckpt: str, ckpt_dir: str | None) -> Decision:
    """The checkpoint to evaluate: ``ckpt`` itself, or with ``ckpt="auto"`` the newest one in ``ckpt_dir`` (a
    checkpoints directory or a run directory holding ``checkpoints/``) that verifies. Raises ConfigError."""
    if ckpt != "auto":
        if not Path(ckpt).is_file():
            raise ConfigError(f"ckpt: no checkpoint file at {ckpt!r}; give a .ckpt path, or ckpt=auto ckpt_dir=DIR")
        return Decision("checkpoint", str(ckpt), "given as ckpt")
    if not ckpt_dir:
        raise ConfigError("ckpt=auto needs ckpt_dir=DIR: a run directory (outputs/train/<run>) or its checkpoints/")
    directory = Path(ckpt_dir)
    if (directory / "checkpoints").is_dir():
        directory = directory / "checkpoints"
    if not directory.is_dir():
        raise ConfigError(f"ckpt_dir: no directory {ckpt_dir!r}")
    from lightning_solo.checkpoint.select import decide_resume

    decision = decide_resume(directory)
    if decision.value is None:
        raise ConfigError(f"ckpt=auto: {decision.reason}")
    return Decision("checkpoint", decision.value, f"ckpt=auto: {decision.reason}")


def find_run_dir(ckpt: str, ckpt_dir: str | None) -> Path | None:
    """The run directory (the one holding ``.hydra/config.yaml``) that ``ckpt_dir`` or the checkpoint ``ckpt``
    belongs to: the directory itself or the one above its ``checkpoints/``; None outside a run directory."""
    places = []
    if ckpt_dir:
        places.append(Path(ckpt_dir))
    if ckpt != "auto":
        places.append(Path(ckpt).parent)
    places += [p.parent for p in places if p.name == "checkpoints"]
    return next((p for p in places if (p / ".hydra" / "config.yaml").is_file()), None)


def with_run_config(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> tuple[DictConfig, Decision]:
    """``cfg`` with the model and data of the run in ``run_dir`` (its ``.hydra/config.yaml``), then this command's
    ``overrides`` on those keys again; a group chosen on the command line (``model=resnet18``) stays as chosen."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = run_dir / ".hydra" / "config.yaml"
    try:
        saved = OmegaConf.load(path)
    except Exception as err:
        raise ConfigError(f"ckpt_dir: cannot read the run's config {path}: {err}") from err
    if not isinstance(saved, DictConfig):
        raise ConfigError(f"ckpt_dir: the run's config {path} is not a mapping")
    parsed = OverridesParser.create().parse_overrides(overrides)
    chosen = {o.key_or_group for o in parsed if o.key_or_group in RUN_GROUPS}
    taken = [group for group in RUN_GROUPS if group not in chosen and group in saved]
    with open_dict(cfg):
        for group in taken:
            cfg[group] = saved[group]
        for override in parsed:
            key = override.key_or_group
            if key.split(".")[0] not in taken or "." not in key:
                continue
            if override.is_delete():
                parent, _, leaf = key.rpartition(".")
                node = OmegaConf.select(cfg, parent)
                if node is not None and leaf in node:
                    del node[leaf]
            else:
                OmegaConf.update(cfg, key, override.value(), merge=True, force_add=True)
    reason = f"{' and '.join(taken) or 'nothing'} as the run trained them, this command's overrides on top"
    if chosen:
        reason += f"; {' and '.join(sorted(chosen))} chosen by this command"
    return cfg, Decision("eval_config", {"config": str(path), "from_run": taken}, reason)


def check_checkpoint_fits(model: Any, ckpt_path: str, hint: str) -> None:
    """Raise :class:`ConfigError` in one line when the checkpoint's weights do not load into ``model`` as Lightning
    loads them (keys, shapes); a directory or a file that is not a Lightning checkpoint is left to Lightning."""
    import torch

    path = Path(ckpt_path)
    if not path.is_file():
        return
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not a checkpoint torch reads: Lightning reports it
        return
    saved = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(saved, dict):
        return
    own = model.state_dict()
    strict = bool(getattr(model, "strict_loading", True))  # a LightningModule may load non-strictly
    missing = [k for k in own if k not in saved] if strict else []
    unexpected = [k for k in saved if k not in own] if strict else []
    shapes = [
        f"{k} {list(saved[k].shape)} in the checkpoint, {list(v.shape)} in the model"
        for k, v in own.items()
        if k in saved and isinstance(saved[k], torch.Tensor) and saved[k].shape != v.shape
    ]
    found = [
        f"{len(items)} {what} (first: {items[0]})"
        for items, what in ((shapes, "shape(s) differ"), (missing, "key(s) missing"), (unexpected, "unexpected key(s)"))
        if items
    ]
    if found:
        raise ConfigError(f"ckpt: {path} does not fit the model: {'; '.join(found)}. {hint}")


def _fit_hint(run_config: Decision | None) -> str:
    if run_config is None:
        return (
            "Give its run directory (ckpt_dir=outputs/train/<run>: its .hydra/config.yaml names the model and "
            "data it trained), or the model and data options it was trained with"
        )
    chosen = [group for group in RUN_GROUPS if group not in run_config.value["from_run"]]
    if chosen:
        return f"This command chose {' and '.join(chosen)} itself: leave that out to take the run's"
    return f"The run's config ({run_config.value['config']}) does not describe this checkpoint"


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
    from lightning.pytorch.utilities import rank_zero_info

    from lightning_solo.callbacks.predictions import OrderedPredictions

    check_run_config(cfg)
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown or not cfg.stages:
        raise ConfigError(f"stages: expected a non-empty list of {', '.join(STAGES)}, got {list(cfg.stages)}")
    run_config = None
    if (run_dir := find_run_dir(str(cfg.ckpt), cfg.get("ckpt_dir"))) is not None:
        cfg, run_config = with_run_config(cfg, run_dir, task_overrides())
        check_config(cfg)
    decision, chose = _checkpoint(cfg)
    try:
        datamodule = hydra.utils.instantiate(cfg.data)
        model = hydra.utils.instantiate(cfg.model)
        check_checkpoint_fits(model, decision.value, _fit_hint(run_config))
        own = [d for d in (decision, run_config) if d is not None]
        for made in own:
            rank_zero_info(f"evaluate: {made}")
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
        report = _report(trainer, own, metrics, predictions)
        close_process_group()
        return report
    finally:
        if chose:
            os.environ.pop(_CHOSEN_ENV, None)


def _report(trainer: Any, own: list[Decision], metrics: dict[str, float], predictions: Any) -> dict[str, Any]:
    from lightning.pytorch.utilities import rank_zero_info

    decisions = [d.as_dict() for k, d in trainer.strategy.decisions.items() if k.startswith("exact_eval")]
    report = {
        "checkpoint": own[0].value,
        "world_size": trainer.world_size,
        "metrics": metrics,
        "decisions": [*(d.as_dict() for d in own), *decisions],
    }
    if trainer.is_global_zero:
        if predictions is not None:
            report["predictions"] = {k: str(v) for k, v in predictions.written.items()}
            report["prediction_counts"] = dict(predictions.counts)
        path = Path(trainer.default_root_dir) / "evaluation.json"
        path.write_text(json.dumps(report, indent=2))
        rank_zero_info(f"evaluate: {json.dumps(metrics)} → {path}")
    return report


def _evaluate_metric(cfg: DictConfig) -> float | None:
    metrics = evaluate(cfg)["metrics"]
    value = metrics.get("val/acc", metrics.get("test/acc"))
    return float(value) if value is not None else None


#: ``python -m lightning_solo.evaluate``: the Hydra app, strategy options set as the runner sets them.
main = hydra_command("evaluate", _evaluate_metric)


if __name__ == "__main__":
    main()
