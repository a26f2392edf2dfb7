"""Exact distributed evaluation: each sample evaluated once on one rank (shards.py), predictions gathered to rank 0
in dataset order (gather.py; the callback is :class:`lightning_solo.callbacks.OrderedPredictions`)."""

from lightning_solo.evaluation.gather import gather_rows, write_predictions
from lightning_solo.evaluation.reduce import mean_operand
from lightning_solo.evaluation.shards import (
    EvalRows,
    ExactEvalBatchSampler,
    decide_eval_sharding,
    eval_rows,
    plan_shards,
    quiet_padding_warning,
    shard_eval_loader,
)

__all__ = [
    "EvalRows",
    "ExactEvalBatchSampler",
    "decide_eval_sharding",
    "eval_rows",
    "gather_rows",
    "mean_operand",
    "plan_shards",
    "quiet_padding_warning",
    "shard_eval_loader",
    "write_predictions",
]
