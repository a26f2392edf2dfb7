"""Distributed evaluation under Lightning's own samplers: which rows are padding repeats (shards.py), predictions
gathered to rank 0 in dataset order (gather.py), and exact ``sync_dist`` epoch means (reduce.py)."""

from lightning_solo.ddp.eval.gather import gather_rows, write_predictions
from lightning_solo.ddp.eval.reduce import decide_exact_eval, mean_operand
from lightning_solo.ddp.eval.shards import EvalRows, eval_rows, rank_order

__all__ = ["EvalRows", "decide_exact_eval", "eval_rows", "gather_rows", "mean_operand", "rank_order",
           "write_predictions"]  # fmt: skip
