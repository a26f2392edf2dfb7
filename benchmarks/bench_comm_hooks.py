"""Step time and gradient error of each SoloDDP comm hook against the exact all-reduce, 2 gloo processes.

Raw DDP over an MLP (no Lightning around it, so the communication is what differs). Every round runs all
hooks, in an order that rotates each round, in the same process group; the figures are medians over rounds,
and ratios are against ``None`` (exact fp32 all-reduce) measured in the same rounds. PowerSGD and
post-local-SGD start their compressed / local phase after 2 steps, so every timed step is in that phase.
``grad err`` is ``|g - g_exact| / |g_exact|`` on one step (post-local-SGD: no gradient exchange at all).

    python benchmarks/bench_comm_hooks.py                    # CPU, this machine
    python benchmarks/bench_comm_hooks.py --width 2048 --rounds 7 --steps 30
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from lightning_solo.ddp.comm.hooks import CommHook
from lightning_solo.testing import run_ranks

HOOKS = (None, "fp16", "bf16", "powersgd", "post_local_sgd")


def make_net(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def run_hook(name, width, steps, rank, world_size) -> tuple[float, float]:
    net = make_net(width)
    ddp = nn.parallel.DistributedDataParallel(net)
    hook = CommHook(name, powersgd_start_iter=2, local_sgd_warmup=2, local_sgd_period=4)
    hook.register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    if name == "post_local_sgd":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        hook.attach_averager(PeriodicModelAverager(period=4, warmup_steps=2))
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(64, 256, generator=gen) for _ in range(4)]

    def step(x):
        opt.zero_grad(set_to_none=False)
        ddp(x).square().mean().backward()
        opt.step()
        if hook.averager is not None:
            hook.averager.average_parameters(ddp.parameters())

    for i in range(3):
        step(batches[i % 4])
    # gradient error of one step against the exact mean, on the current parameters
    ref = make_net(width)
    ref.load_state_dict(net.state_dict())
    ref(batches[0]).square().mean().backward()
    exact = torch.cat([p.grad.flatten() for p in ref.parameters()])
    dist.all_reduce(exact)
    exact /= world_size
    opt.zero_grad(set_to_none=False)
    ddp(batches[0]).square().mean().backward()
    got = torch.cat([p.grad.flatten() for p in net.parameters()])
    err = ((got - exact).norm() / exact.norm()).item()
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % 4])
    dist.barrier()
    return (time.perf_counter() - start) / steps, err


def bench(rank, world_size, width, steps, rounds, threads):
    torch.set_num_threads(threads)
    times: dict = {h: [] for h in HOOKS}
    errors: dict = {}
    for r in range(rounds):
        order = HOOKS[r % len(HOOKS) :] + HOOKS[: r % len(HOOKS)]
        for name in order:
            t, err = run_hook(name, width, steps, rank, world_size)
            times[name].append(t)
            errors[name] = err
    return times, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    args = parser.parse_args()
    params = sum(p.numel() for p in make_net(args.width).parameters())
    times, errors = run_ranks(bench, 2, args.width, args.steps, args.rounds, args.threads, timeout=1800)[0]
    base = statistics.median(times[None])
    print(
        f"MLP width {args.width} ({params / 1e6:.2f} M params), 2 gloo processes, {args.steps} steps x {args.rounds} rounds"
    )
    print(f"{'comm_hook':<16}{'ms/step':>10}{'vs None':>10}{'grad err':>12}")
    for name in HOOKS:
        med = statistics.median(times[name])
        print(f"{name!s:<16}{med * 1e3:>10.1f}{base / med:>9.2f}x{errors[name]:>12.1e}")


if __name__ == "__main__":
    main()
