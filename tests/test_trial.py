"""The trial behind comm_hook="auto" and compile="auto" (lightning_solo/ddp/trial.py): each optimizer step is timed
from the batch start that opens it to its end, micro-batches of an accumulation included and the time between steps
left out; the arms follow the schedule; on 2 gloo ranks one MAX all-reduce gives both ranks the same times."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_solo.ddp.trial import Trial
from lightning_solo.testing import run_ranks

CPU = torch.device("cpu")


def test_a_step_is_timed_from_its_first_batch_to_its_end_and_the_arms_follow_the_schedule():
    trial = Trial([None, "a", "b"])
    arms, new_steps = [], []
    for _ in range(3):  # 3 optimizer steps of 2 micro-batches each, 20 ms apiece; 300 ms between steps
        arms.append(trial.arm)
        for _ in range(2):
            new_steps.append(trial.batch_start(CPU))
            time.sleep(0.02)
        trial.step_end(CPU)
        time.sleep(0.3)  # validation, a checkpoint: not in the step's time
    assert arms == [None, "a", "b"] and trial.done and trial.arm is None
    assert new_steps == [False, False, True, False, True, False]  # True: the batch after a step's end
    assert all(0.04 <= t < 0.3 for t in trial.times), trial.times  # both micro-batches, not the gap
    assert trial.agree(CPU) == {"a": [trial.times[1]], "b": [trial.times[2]]}  # no process group: this rank's


def test_a_resumed_trial_continues_where_it_was():
    trial = Trial([None, "a", "a", "b"], times=[0.1, 0.2], stepped=True)
    assert (trial.arm, trial.done) == ("a", False)
    assert trial.batch_start(CPU)  # the saved step had ended: a new one starts here
    trial.step_end(CPU)
    assert len(trial.times) == 3 and trial.arm == "b"


def _agree(rank: int, world_size: int) -> dict[str, list[float]]:
    trial = Trial(["x", "y", "y"], times=[1.0 + rank, 5.0 - rank, 2.0 * rank])  # each rank its own times
    return trial.agree(CPU)


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_ranks_agree_on_the_slowest_rank_per_step():
    first, second = run_ranks(_agree)
    assert first == second == {"x": [2.0], "y": [5.0, 2.0]}
