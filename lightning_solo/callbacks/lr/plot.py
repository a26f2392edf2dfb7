"""The lr schedule of :class:`~lightning_solo.callbacks.WarmupScaledLR` as a PNG; needs matplotlib (the
``plot`` extra)."""

from __future__ import annotations

from pathlib import Path

from lightning_solo.callbacks.lr.schedule import LRSchedule


def plot_schedule(
    path: str | Path,
    schedule: LRSchedule,
    base_lr: float = 1.0,
    title: str | None = None,
    steps_per_epoch: int | None = None,
) -> Path:
    """Write the lr curve ``base_lr × schedule.factor(s)`` over the whole run to a PNG; returns the path."""
    try:
        from matplotlib.figure import Figure  # not pyplot: leaves the user's backend (a notebook's) alone
    except ImportError as err:
        raise ImportError(
            "plot_schedule needs matplotlib, an optional dependency: pip install 'lightning_solo[plot]'"
        ) from err

    steps = list(range(schedule.total_steps))
    lrs = [base_lr * schedule.factor(s) for s in steps]
    fig = Figure(figsize=(6, 3.2), dpi=120)
    ax = fig.subplots()
    xs = [s / steps_per_epoch for s in steps] if steps_per_epoch else steps
    ax.plot(xs, lrs, lw=1.6)
    ax.axhline(base_lr, color="grey", lw=0.8, ls=":", label=f"base lr {base_lr:g}")
    if schedule.warmup_steps:
        end = schedule.warmup_steps / steps_per_epoch if steps_per_epoch else schedule.warmup_steps
        ax.axvline(end, color="tab:orange", lw=0.8, ls="--", label="end of warmup")
    ax.set_xlabel("epoch" if steps_per_epoch else "optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(title or f"scale ×{schedule.scale:g}, warmup {schedule.warmup_steps} steps, decay {schedule.decay}")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
