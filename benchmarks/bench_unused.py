"""Throughput of find_unused_parameters="auto" vs True vs False, 2 gloo processes on CPU.

Two models: an MLP that uses every parameter, and the same MLP with a large head that is never called.
``False`` cannot train the second one (DDP raises on the second step), so there it is shown as such.
Each rank runs a plain DDP loop that makes the same policy calls as SoloDDP (``at_boundary`` before a
batch, ``before_backward``/``after_backward`` around backward, the re-wrap), so the figures are the policy's
cost and nothing else. Every setting
has its own copy of the model (same initial weights); after ``--warmup`` untimed steps (which include auto's
4-step evidence window and its re-wrap) the settings run in short blocks, interleaved in a rotating order,
and the figures are the median over blocks of rank 0's steps per second and, for the ratios, the
median of the per-rotation ratios (blocks that ran back to back).

    python benchmarks/bench_unused.py                 # ~1 minute on 2 idle cores
    python benchmarks/bench_unused.py --blocks 30 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

from lightning_solo.testing import run_ranks

WIDTH, DEPTH, HEAD, BATCH = 512, 4, 4096, 64


def _model(head: bool):
    import torch.nn as nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            layers = []
            for _ in range(DEPTH):
                layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
            self.body, self.out = nn.Sequential(*layers), nn.Linear(WIDTH, 10)
            if head:  # e.g. a pretrained model's old classifier, still registered
                self.unused_head = nn.Linear(WIDTH, HEAD)

        def forward(self, x):
            return self.out(self.body(x))

    return MLP()


class _Run:
    """One setting on one model: its own weights (same initial values), DDP wrapper, policy and optimizer."""

    def __init__(self, setting, head: bool, rank: int, group):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from lightning_solo.ddp.unused.policy import UnusedParameters

        torch.manual_seed(0)
        self.model = _model(head)
        self.policy = UnusedParameters(setting)
        ddp = DDP(self.model, find_unused_parameters=self.policy.initial, gradient_as_bucket_view=True)
        self.ddp, self.group = self.policy.bind(ddp, group), group
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(rank)
        self.x, self.y = (
            torch.randn(BATCH, WIDTH, generator=data),
            torch.randint(0, 10, (BATCH,), generator=data),
        )
        self.policy_s, self.policy_steps = 0.0, 0  # time inside the policy's calls

    def steps(self, n: int) -> None:
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel as DDP

        for _ in range(n):
            t0 = time.perf_counter()
            rewrap = self.policy.at_boundary(self.ddp)  # what SoloDDP.on_train_batch_start does
            t1 = time.perf_counter()
            if rewrap:  # what SoloDDP._rewrap does
                self.ddp = self.policy.rebuild(self.policy.unwrap(self.ddp), lambda module: DDP(
                    module, find_unused_parameters=self.policy.find_unused, gradient_as_bucket_view=True,
                    init_sync=False), self.group)  # fmt: skip
            t1b = time.perf_counter()
            self.policy.before_backward(self.ddp)  # what SoloDDP.backward does around backward
            t1c = time.perf_counter()
            F.cross_entropy(self.ddp(self.x), self.y).backward()
            t2 = time.perf_counter()
            self.policy.after_backward(self.ddp)
            self.policy_s += time.perf_counter() - t2 + t1 - t0 + t1c - t1b
            self.policy_steps += 1
            self.opt.step()
            self.opt.zero_grad()


def _worker(rank: int, world: int, args) -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    from lightning.pytorch.utilities import rank_zero_only

    torch.set_num_threads(1)
    rank_zero_only.rank = rank
    warnings.filterwarnings("ignore")
    results: dict = {}
    side_channel = dist.new_group(backend="gloo")  # SoloDDP's: a gloo group apart from DDP's
    for head in (False, True):
        # False on the unused-head model raises on its second step (and leaves the peer waiting): not run.
        runs = {s: _Run(s, head, rank, side_channel) for s in (["auto", True] if head else ["auto", True, False])}
        for run in runs.values():
            run.steps(args.warmup)  # includes auto's evidence window and its re-wrap
        names = list(runs)
        for run in runs.values():
            run.policy_s, run.policy_steps = 0.0, 0
        for block in range(args.blocks):
            # Short blocks, the settings interleaved in a rotating order: load changes hit all alike.
            for setting in names[block % len(names) :] + names[: block % len(names)]:
                dist.barrier()
                start = time.perf_counter()
                runs[setting].steps(args.steps)
                results.setdefault((head, setting), []).append(args.steps / (time.perf_counter() - start))
        results[head, "decision"] = str(runs["auto"].policy.decision)
        results[head, "policy_us"] = 1e6 * runs["auto"].policy_s / runs["auto"].policy_steps
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=15, help="timed blocks per setting")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--warmup", type=int, default=12, help="untimed steps first (auto's window is 4)")
    args = parser.parse_args()
    results = run_ranks(_worker, 2, args, timeout=1800)[0]

    def median(head, setting):
        return statistics.median(results[head, setting])

    print(f"MLP {DEPTH}x{WIDTH}, batch {BATCH}/rank, 2 gloo processes x 1 thread; {args.blocks} interleaved blocks "
          f"of {args.steps} steps per setting after {args.warmup} untimed; median steps/s of rank 0")  # fmt: skip
    print(f"{'model':<18}{'auto':>10}{'True':>10}{'False':>10}   ratios")

    def ratio(head, a, b):
        # Paired: the blocks of one rotation ran back to back, so their ratio cancels slow load changes.
        return statistics.median(x / y for x, y in zip(results[head, a], results[head, b]))

    used = {s: median(False, s) for s in ("auto", True, False)}
    print(f"{'all used':<18}{used['auto']:>10.1f}{used[True]:>10.1f}{used[False]:>10.1f}   "
          f"auto/False = {ratio(False, 'auto', False):.3f}, auto/True = {ratio(False, 'auto', True):.3f}")  # fmt: skip
    head = {s: median(True, s) for s in ("auto", True)}
    print(f"{'unused head':<18}{head['auto']:>10.1f}{head[True]:>10.1f}{'fails':>10}   "
          f"auto/True = {ratio(True, 'auto', True):.3f}  (head {WIDTH}x{HEAD} never called)")  # fmt: skip
    print("ratios: median over rotations of the paired per-block ratios")
    for h in (False, True):
        print(f"auto ({'unused head' if h else 'all used'}): {results[h, 'policy_us']:.0f} us per step inside the "
              f"policy's calls, {100 * results[h, 'policy_us'] * (head if h else used)['auto'] / 1e6:.2f}% of a step; "
              f"{results[h, 'decision']}")  # fmt: skip
    quartiles = {k: statistics.quantiles(v, n=4) for k, v in results.items() if k[1] not in ("decision", "policy_us")}
    print(
        "interquartile range (steps/s):",
        ", ".join(f"{'head' if h else 'used'}/{s}: {q[0]:.1f}..{q[2]:.1f}" for (h, s), q in quartiles.items()),
    )


if __name__ == "__main__":
    main()
