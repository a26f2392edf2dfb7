"""SoloDDP() as a drop-in for DDPStrategy on ordinary Lightning code (issue 26, item 8).

Every pattern of :mod:`tests.conformance.patterns` runs under stock ``DDPStrategy`` and under ``SoloDDP()``:
on 2 gloo ranks that live through the whole corpus (:mod:`tests.conformance.runner`), and on ``devices=1`` as a
plain script starts. Each test asserts, for one pattern: the same outcome under both; identical replicas on
every rank; and the same final weights (and extras: metrics, gathered rows, ...) as stock wherever the semantics
are the same (against ``SoloDDP`` with a documented default turned off where the pattern says so). Two more
tests start the ranks with Lightning's fork and spawn launchers.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_solo import SoloDDP
from tests.conformance.patterns import PATTERNS, Pattern
from tests.conformance.runner import fit_once, run_corpus

CORPUS_TIMEOUT_S = 420  # the first test of each kind runs every selected pattern (its fixture)


def _selected(request, test: str) -> list[str]:
    """The patterns this session runs ``test`` on (all, or those picked with ``-k``)."""
    items = request.session.items
    return [i.callspec.params["name"] for i in items if i.path == request.path and i.originalname == test]


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    return run_corpus(_selected(request, "test_pattern"), str(tmp_path_factory.mktemp("two_ranks")))


@pytest.fixture(scope="module")
def one_device(request, tmp_path_factory):
    names, root = _selected(request, "test_pattern_one_device"), str(tmp_path_factory.mktemp("one_device"))
    return run_corpus(names, root, world_size=1)


def close(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, (float, torch.Tensor)):
        return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-5, atol=1e-6)
    return a == b


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys {sorted(a.keys() ^ b.keys())}"]
    return [k for k in a if not torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6)]


def check(pattern: Pattern, ranks: list[dict]) -> None:
    failed = [f"{v} on rank {r}: {o['error']}  [from {o['where']}]" for r, res in enumerate(ranks)
              for v, o in res.items() if o["error"]]  # fmt: skip
    assert not failed, "\n".join(failed)
    for variant in ranks[0]:  # pattern.also's run included
        if variant == "stock" and not pattern.stock_replicas:
            continue  # pattern.why: stock DDP itself lets them diverge
        for r in ranks[1:]:
            assert not differing(ranks[0][variant]["weights"], r[variant]["weights"]), f"{variant}: replicas differ"
    if not pattern.weights:
        return  # pattern.why says why the weights are not comparable
    compared = "solo_off" if pattern.solo else "solo"
    for rank, r in enumerate(ranks):
        stock, solo = r["stock"], r[compared]
        assert not (keys := differing(stock["weights"], solo["weights"])), f"{compared} != stock in {keys}"
        assert close(stock["extras"], solo["extras"]), f"rank {rank}: {solo['extras']} != stock {stock['extras']}"


@pytest.mark.multiproc
@pytest.mark.timeout(CORPUS_TIMEOUT_S)
@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern(two_ranks, name):
    check(PATTERNS[name], two_ranks[name])


@pytest.mark.multiproc
@pytest.mark.timeout(CORPUS_TIMEOUT_S)
@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_one_device(one_device, name):
    check(PATTERNS[name], one_device[name])


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("start_method", "name"), [("fork", "validate_and_test_before_fit"), ("spawn", "dropout")])
def test_launchers(tmp_path, monkeypatch, start_method, name):
    """The ranks started by Lightning's launcher from this process; the trained weights come back to it. Stock
    runs under the fork launcher either way: spawned ranks start as fresh interpreters (~8 s each importing
    Lightning), and the ranks of both launchers start from this process's seeded RNG state, so stock forked is
    the same reference."""
    # seed_everything and the launcher set these in this process: each is recorded, removed, and put back after.
    for var in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    runs = {
        "stock": partial(DDPStrategy, start_method="fork"),
        "solo": partial(SoloDDP, start_method=start_method),
    }
    pattern = PATTERNS[name]
    result = {}
    for v, make in runs.items():
        for attempt in range(2):
            result[v] = fit_once(pattern, make, str(tmp_path / f"{v}{attempt}"))
            # A spawned rank sometimes aborts at interpreter exit, after its fit ("terminate called without an
            # active exception" in torch's gloo teardown): seen with stock DDPStrategy too (1 run in 8 here), and
            # Lightning marks its own spawn tests flaky for it. Once more then; a second abort fails the test.
            if "SIGABRT" not in str(result[v].get("error", "")):
                break
    check(pattern, [result])
