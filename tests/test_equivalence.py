"""2 ranks x batch B under SoloDDP == 1 process x batch 2B, after K SGD steps (with and without accumulation).

The fits go through SoloDDP's fork launcher on CPU/gloo, with the default ``find_unused_parameters="auto"``:
its evidence window ends inside the run, so these tests also show that the decision (and any re-wrap) does
not disturb training. Each rank shards the data with ``DistributedSampler(shuffle=False)`` (Lightning's own
sampler always shuffles the training set), so that the union of the ranks' batches at step k is the single
process's batch k. The model has no BatchNorm. The harness is :mod:`tests.helpers.equivalence`.
"""

from __future__ import annotations

import pytest
import torch

from lightning_solo import SoloDDP
from tests.helpers.equivalence import TOL, Net, assert_ranks_identical, fit, make_data, max_rel_err, reference


@pytest.mark.multiproc
@pytest.mark.parametrize("accumulate", [1, 2])
def test_two_ranks_equal_one_process_with_double_batch(tmp_path, accumulate):
    torch.manual_seed(0)
    net = Net("used", make_data(accumulate=accumulate))
    records = fit(tmp_path, net, SoloDDP(start_method="fork"), accumulate=accumulate)
    assert_ranks_identical(records)
    assert max_rel_err(records[0], reference(net, accumulate)) <= TOL
    # All parameters used: the evidence window on True, then the fast path.
    decision = records[0]["decisions"]["find_unused_parameters"]
    assert decision["value"] is False and "every parameter got a gradient" in decision["reason"]
    assert records[0]["ddp"] == {"find_unused_parameters": False, "ignored": [], "comm_hook": None}
    assert records[0]["wrappers"] == 2
    assert records[0]["warnings"] == []
