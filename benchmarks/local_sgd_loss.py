"""What post-local-SGD costs in loss on the communication-bound MLP of ``compare --sections comm``, over several
data orders, and whether an outer momentum on the averages (SlowMo, Wang et al. 2020) buys a longer period.

The two replicas are simulated in one process: the same network, data, shards (``DistributedSampler`` with
``seed`` as the order), SGD lr 0.01 momentum 0.9, 16 synchronous steps, then local steps averaged every
``period``, and the held-out loss of the final average. No timing: the loss of each lever at the same
hyperparameters, which the 2-process runs cannot afford over many orders. Exact DDP here reproduces the real
runs' held-out loss (1.7600 for order 0).

Usage::

    python -m benchmarks.local_sgd_loss                 # orders 0-2, ~6 min on 2 cores
    python -m benchmarks.local_sgd_loss --orders 0 1
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn.functional as F

from benchmarks.compare_worker import build_workload

SPEC = {"workload": "mlp", "width": 2048, "layers": 3, "batch": 8, "batches": 160, "warmup": 16, "lr": 0.01}


def shards(n: int, order: int) -> list[list[int]]:
    """``DistributedSampler(shuffle=True, seed=order)``'s indices for 2 ranks, epoch 0."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(order)).tolist()
    return [perm[r::2] for r in range(2)]


def held_out_loss(period: int | None, order: int, lr: float = 0.01, outer: tuple[float, float] | None = None) -> float:
    """``period`` None: exact DDP (gradients averaged every step). ``outer``: (outer lr, outer momentum) applied to
    each average's move from the previous average."""
    net, data, held_out = build_workload(SPEC, world=2)
    x, y = data.tensors
    idx, batch = shards(len(y), order), SPEC["batch"]
    replicas = [copy.deepcopy(net) for _ in range(2)]
    optimizers = [torch.optim.SGD(r.parameters(), lr=lr, momentum=0.9) for r in replicas]
    pairs = list(zip(*(r.parameters() for r in replicas)))
    anchor: list[torch.Tensor] = []  # the last average
    velocity = [torch.zeros_like(a) for a, _ in pairs]
    for step in range(SPEC["batches"]):
        for r, (model, opt) in enumerate(zip(replicas, optimizers)):
            opt.zero_grad()
            b = idx[r][step * batch : (step + 1) * batch]
            F.cross_entropy(model(x[b]), y[b]).backward()
        local = period is not None and step >= SPEC["warmup"]
        if not local:
            for a, b in pairs:
                a.grad.add_(b.grad).div_(2)
                b.grad.copy_(a.grad)
        for opt in optimizers:
            opt.step()
        if step == SPEC["warmup"] - 1:  # the replicas are one model until here: the outer steps start from it
            anchor = [a.detach().clone() for a, _ in pairs]
        if local and (step - SPEC["warmup"] + 1) % period == 0:
            with torch.no_grad():
                for i, (a, b) in enumerate(pairs):
                    average = (a + b) / 2
                    if outer is not None:
                        outer_lr, momentum = outer
                        velocity[i].mul_(momentum).add_(anchor[i] - average)
                        average = anchor[i] - outer_lr * velocity[i]
                    anchor[i].copy_(average)
                    a.copy_(average)
                    b.copy_(average)
    with torch.no_grad():
        for a, b in pairs:
            a.copy_((a + b) / 2)
        replicas[0].eval()
        hx, hy = held_out.tensors
        return F.cross_entropy(replicas[0](hx), hy).item()


RUNS: dict[str, dict] = {
    "exact DDP": {"period": None},
    "exact DDP, lr × 2": {"period": None, "lr": 0.02},
    "post_local_sgd, period 4": {"period": 4},
    "post_local_sgd, period 8": {"period": 8},
    "post_local_sgd, period 16": {"period": 16},
    "period 8, outer momentum 0.5, outer lr 1 (SlowMo)": {"period": 8, "outer": (1.0, 0.5)},
    "period 8, outer momentum 0.5, outer lr 0.5 (same step size)": {"period": 8, "outer": (0.5, 0.5)},
    "period 16, outer momentum 0.5, outer lr 1": {"period": 16, "outer": (1.0, 0.5)},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, nargs="+", default=[0, 1, 2], help="data orders (sampler seeds)")
    args = parser.parse_args(argv)
    losses = {name: [] for name in RUNS}
    for order in args.orders:
        for name, run in RUNS.items():
            losses[name].append(held_out_loss(order=order, **run))
            print(f"order {order}: {name}: {losses[name][-1]:.4f}", flush=True)
    exact = losses["exact DDP"]
    orders = ", ".join(str(o) for o in args.orders)
    print(f"\n| run | held-out loss, orders {orders} | Δ vs exact DDP per order | median Δ |\n|---|---|---|---|")
    for name, values in losses.items():
        deltas = [100 * (v / e - 1) for v, e in zip(values, exact)]
        cells = ", ".join(f"{v:.4f}" for v in values), ", ".join(f"{d:+.1f} %" for d in deltas)
        print(f"| {name} | {cells[0]} | {cells[1]} | {statistics.median(deltas):+.1f} % |")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
