"""The doctor's chart (``doctor.png``): the time split per step, global throughput and every rank's loss against the
optimizer step. Needs matplotlib (the ``plot`` extra); without it :func:`plot_doctor` returns ``None``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PARTS = (("data_ms", "data wait"), ("compute_ms", "forward+backward"), ("comm_ms", "exposed comm"),
         ("optimizer_ms", "optimizer"))  # fmt: skip


def plot_doctor(series: dict[str, Any], path: str | Path, title: str = "TrainingDoctor") -> Path | None:
    """Write the chart to ``path``; ``None`` when matplotlib is missing or there is nothing to plot."""
    try:
        from matplotlib.figure import Figure  # not pyplot: leaves the user's backend (a notebook's) alone
    except ImportError:
        return None
    steps, ranks = series["step"], series["ranks"]
    if not steps or not ranks:
        return None
    fig = Figure(figsize=(8, 9))
    split, speed, loss = fig.subplots(3, 1, sharex=True)
    # Each bin is drawn over its steps; the split is the mean rank's (ranks wait for each other).
    edges = [steps[0] - ranks[0]["steps"][0], *steps]

    def held(values: list[Any]) -> list[Any]:
        return [*values, values[-1]]

    stacked = [held([sum(r[key][i] for r in ranks) / len(ranks) for i in range(len(steps))]) for key, _ in PARTS]
    split.stackplot(edges, stacked, labels=[label for _, label in PARTS], step="post")
    split.set_ylabel("ms per step (mean rank)")
    split.legend(loc="upper right", fontsize="small")
    speed.plot(edges, held(series["global_samples_per_s"]), drawstyle="steps-post")
    speed.set_ylabel("samples/s (all ranks)")
    speed.set_ylim(bottom=0)
    for rank, r in enumerate(ranks):
        points = [(s, v) for s, v in zip(edges, held(r["loss"])) if v is not None]
        if points:
            loss.plot(*zip(*points), drawstyle="steps-post", label=f"rank {rank}")
    loss.set_ylabel("loss")
    loss.set_xlabel("optimizer step")
    if len(ranks) <= 16:
        loss.legend(loc="upper right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path
