"""torch.compile under SoloDDP on 2 gloo processes: eager SoloDDP, ``SoloDDP(compile=True)`` and stock
``DDPStrategy`` with ``fit(torch.compile(model))``, through Lightning, for an MLP, a small transformer stack and
benchmarks/compare.py's ResNet-18.

Each fit is one configuration (its own 2 forked ranks); the configurations run in rounds, their order rotated
each round, and the figures are medians over rounds of rank 0's numbers: the steady step time (median of the
steps after ``--warmup``), the compile time (the first step minus the steady step; round 1 compiles cold, later
rounds hit inductor's on-disk cache: both are shown), DDP's exposed communication per step (the reducer's
backward communication minus its overlap with compute, every step sampled), the backward compute left after
the step's first bucket was launched (the overlap a split keeps: the first layer's weight gradient, the last
backward computes, minus the launch, timed by a comm hook doing DDP's own all-reduce; about 0 when every
gradient arrives at the end of one compiled backward), and the relative difference of the final weights from
eager SoloDDP's (same seed and data). A last fit per model runs ``compile="auto"`` and
prints what it kept and why.

    python benchmarks/bench_compile.py                      # every model: ~25 minutes on 2 idle cores
    python benchmarks/bench_compile.py --rounds 2 --steps 20 --models mlp
    python benchmarks/bench_compile.py --models mlp --rounds 5 --bucket-cap-mb 1 --no-auto   # more buckets
    python benchmarks/bench_compile.py --models transformer --rounds 6 --bucket-cap-mb 1 --link-ms 6 --no-auto
        # exposed communication over a simulated slow serial link (6 ms per bucket)
    python benchmarks/bench_compile.py --single            # the models alone: one process, no DDP
    python benchmarks/bench_compile.py --single --models resnet18 --batch 32   # and their gradient parity
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import warnings

try:
    from benchmarks.stats import median_interval
except ImportError:  # run as a script: python benchmarks/bench_compile.py
    from stats import median_interval  # type: ignore[no-redef]

MODELS = {
    # name: (builder kwargs, batch per rank)
    "mlp": ({"kind": "mlp"}, 64),  # 256 -> 1024 -> 1024 -> 10, 1.3 M parameters
    # 4 layers, d=256, 4 heads, seq 128 (--seq), 3.5 M parameters
    "transformer": ({"kind": "transformer"}, 4),
    # benchmarks/compare.py's ResNet-18 (CIFAR stem, 11.2 M parameters) on 3x32x32 images; batch 16 for CPU time
    # (--batch 32: compare.py's)
    "resnet18": ({"kind": "resnet18"}, 16),
}
# solo_compile_no_split: SoloDDP(compile=True) with torch._dynamo.config.optimize_ddp=False (no DDPOptimizer).
CONFIGS = ("eager", "solo_compile", "solo_compile_no_split", "stock_compile")
SEQ, D, LAYERS = 128, 256, 4  # issue 30: 4 layers, d=256, seq 128


def _timed_allreduce(timer, bucket):
    """DDP's all-reduce (``allreduce_hook``), noting when the step's first bucket was launched. With
    ``timer.link_ms``, each bucket then also crosses a simulated serial link: it is delivered ``link_ms`` after
    the later of its all-reduce's end and the previous bucket's delivery, by a timer thread, so the wait costs no
    CPU and a slow network's exposed time stands out of this machine's CPU noise."""
    import threading

    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if timer.first_launch is None:
        timer.first_launch = time.perf_counter()
    timer.launches.append(time.perf_counter())
    reduced = default_hooks.allreduce_hook(None, bucket)
    if not timer.link_ms:
        return reduced
    delivered: torch.futures.Future = torch.futures.Future()

    def send(fut):
        with timer.link_lock:
            now = time.perf_counter()
            timer.link_free = max(now, timer.link_free) + timer.link_ms / 1e3
            delay = timer.link_free - now
        try:
            value = fut.value()
        except RuntimeError as error:  # the all-reduce failed: DDP's wait raises it, as without the link
            return delivered.set_exception(error)
        threading.Timer(delay, delivered.set_result, (value,)).start()

    reduced.add_done_callback(send)
    return delivered


def _module(kind: str, batch: int, steps: int):
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Bench(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            if kind == "mlp":
                self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                         nn.Linear(1024, 10))  # fmt: skip
            elif kind == "resnet18":
                from lightning_solo.app.models import build_backbone

                self.net = build_backbone("resnet18", 10, stem="cifar")
            else:
                layer = nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.0, batch_first=True)
                self.net = nn.Sequential(nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False),
                                         nn.Flatten(), nn.Linear(SEQ * D, 10))  # fmt: skip

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            # At 0.01 the transformer's loss climbs from 2.4 to over 100 in 16 steps, and eager and compiled
            # runs part by 1e-3 through that divergence alone; at 1e-3 it trains.
            return torch.optim.SGD(self.parameters(), lr=1e-3 if kind == "transformer" else 0.01)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            n = batch * 2 * steps
            shape = {"mlp": (256,), "resnet18": (3, 32, 32)}.get(kind, (SEQ, D))
            x = torch.randn(n, *shape, generator=g)
            return DataLoader(TensorDataset(x, torch.randint(0, 10, (n,), generator=g)), batch_size=batch)

    return Bench()


def _fit(model_name: str, config: str, steps: int, warmup: int, out: str, compile_setting=True,
         planned: int | None = None, bucket_cap_mb: float | None = None, link_ms: float = 0) -> dict:  # fmt: skip
    """One fit of ``steps`` steps; ``planned``: ``max_steps`` as the Trainer sees it (the fit stops at ``steps``)."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_solo import SoloDDP
    from lightning_solo._compat import torch as torch_compat

    kwargs, batch = MODELS[model_name]
    module = _module(kwargs["kind"], batch, steps)

    class Timer(L.Callback):
        def __init__(self):
            self.times, self.wrapper, self.exposed, self.overlap, self.waited = [], None, [], [], []
            self.first_launch = self.last_grad = None
            self.link_ms, self.link_lock, self.link_free = link_ms, threading.Lock(), 0.0
            self.launches, self.launch_offsets = [], []  # each bucket's launch, ms before the last gradient
            self.grad_hook = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.strategy.model is not self.wrapper:  # a new DDP wrapper (SoloDDP re-wraps): sample all
                self.wrapper = trainer.strategy.model
                torch_compat.set_ddp_runtime_logging_sample_rate(self.wrapper, 1)
                self.wrapper.register_comm_hook(self, _timed_allreduce)  # DDP's own all-reduce, timed
            if self.grad_hook is None:  # the first layer's weight: the last gradient backward computes
                first = next(pl_module.parameters())
                self.grad_hook = first.register_post_accumulate_grad_hook(
                    lambda p: setattr(self, "last_grad", time.perf_counter())
                )
            self.first_launch = self.last_grad = None
            self.launches = []
            self.started = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            # backward has returned, DDP's reducer has waited for every bucket: the wait past the last gradient
            if self.last_grad is not None and trainer.global_step >= warmup:
                self.waited.append((time.perf_counter() - self.last_grad) * 1e3)
                self.launch_offsets.append([round((self.last_grad - t) * 1e3, 1) for t in self.launches])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self.started)
            if trainer.global_step >= steps:  # a fit planned longer than it runs ("auto")
                trainer.should_stop = True
            if trainer.global_step > warmup:
                data = torch_compat.ddp_logging_data(self.wrapper)
                comm, overlap = (
                    data.get("avg_backward_comm_time", 0),
                    data.get("avg_backward_compute_comm_overlap_time", 0),
                )
                self.exposed.append((comm - overlap) / 1e6)  # fmt: skip
                if self.first_launch is not None and self.last_grad is not None:
                    self.overlap.append((self.last_grad - self.first_launch) * 1e3)

        def on_fit_end(self, trainer, pl_module):
            if trainer.global_rank != 0:
                return
            steady = statistics.median(self.times[warmup:])
            vector = torch.nn.utils.parameters_to_vector(pl_module.parameters()).detach()
            torch.save(vector, os.path.join(out, f"{model_name}-{config}.pt"))
            decision = getattr(trainer.strategy, "decisions", {}).get("compile")
            record = {
                "steady_ms": steady * 1e3,
                "compile_s": self.times[0] - steady,
                "exposed_ms": statistics.median(self.exposed) if self.exposed else None,
                "overlap_ms": statistics.median(self.overlap) if self.overlap else None,
                "waited_ms": statistics.median(self.waited) if self.waited else None,
                "launches_ms_before_last_grad": [statistics.median(b) for b in zip(*self.launch_offsets)],
                "buckets": str(torch_compat.ddp_logging_data(self.wrapper).get("rebuilt_bucket_sizes")),
                "decision": str(decision) if decision else None,
            }
            with open(os.path.join(out, f"{model_name}-{config}.json"), "w") as f:
                json.dump(record, f)

    ddp = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    if config == "stock_compile":
        strategy, fit_model = DDPStrategy(start_method="fork", **ddp), torch.compile(module)
    else:
        strategy = SoloDDP(start_method="fork", compile=False if config == "eager" else compile_setting, **ddp)
        fit_model = module
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=planned or steps, callbacks=[Timer()],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    import torch._dynamo

    with torch._dynamo.config.patch(optimize_ddp=config != "solo_compile_no_split"):  # the forked ranks inherit it
        trainer.fit(fit_model)
    with open(os.path.join(out, f"{model_name}-{config}.json")) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps (unused window, re-wrap)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's (default: its 25)")
    parser.add_argument("--no-auto", action="store_true", help="skip the compile='auto' fits")
    parser.add_argument("--single", action="store_true", help="only: one process, no DDP, eager vs compiled")
    parser.add_argument("--auto-steps", type=int, default=2000, help="max_steps of the compile='auto' fit's plan")
    parser.add_argument(
        "--link-ms", type=float, default=0, help="a simulated serial link: each bucket also takes this long"
    )
    parser.add_argument("--seq", type=int, default=SEQ, help="the transformer's sequence length")
    parser.add_argument("--batch", type=int, default=None, help="batch per rank for every model (default: MODELS')")
    args = parser.parse_args()
    globals()["SEQ"] = args.seq  # read by _module in the forked ranks
    if args.batch:
        MODELS.update({name: (MODELS[name][0], args.batch) for name in args.models})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    if args.single:
        return _single(args.models)
    out = tempfile.mkdtemp(prefix="bench_compile_")
    rows: dict[tuple[str, str], list[dict]] = {}
    for model_name in args.models:
        for r in range(args.rounds):
            order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]
            for config in order:
                started = time.perf_counter()
                rec = _fit(model_name, config, args.steps, args.warmup, out, bucket_cap_mb=args.bucket_cap_mb,
                           link_ms=args.link_ms)  # fmt: skip
                rec["wall_s"] = time.perf_counter() - started
                rows.setdefault((model_name, config), []).append(rec)
                print(model_name, config, f"round {r + 1}", {k: v for k, v in rec.items() if k != "decision"},
                      flush=True)  # fmt: skip
    print("\n| model | configuration | steady ms/step | vs eager | compile s (cold / warm) | exposed comm ms/step | "
          "paired ratio to eager (95 %) | waited after the last gradient ms | paired ratio to eager (95 %) | "
          "backward after the first bucket ms | weights vs eager (rel) |\n|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for model_name in args.models:
        eager = statistics.median(r["steady_ms"] for r in rows[(model_name, "eager")])
        for config in CONFIGS:
            recs = rows[(model_name, config)]
            steady = statistics.median(r["steady_ms"] for r in recs)
            exposed = [r["exposed_ms"] for r in recs if r["exposed_ms"] is not None]
            after = [r["overlap_ms"] for r in recs if r["overlap_ms"] is not None]
            after_ms = f"{statistics.median(after):.2f}" if after else "-"
            compile_s = f"{recs[0]['compile_s']:.1f} / {statistics.median(r['compile_s'] for r in recs[1:]):.1f}" \
                if config != "eager" and len(recs) > 1 else "-"  # fmt: skip
            waited = [r["waited_ms"] for r in recs if r["waited_ms"] is not None]
            print(f"| {model_name} | {config} | {steady:.1f} | {eager / steady:.2f}x | {compile_s} | "
                  f"{statistics.median(exposed):.2f} | {_paired(rows, model_name, config, 'exposed_ms')} | "
                  f"{statistics.median(waited):.2f} | {_paired(rows, model_name, config, 'waited_ms')} | "
                  f"{after_ms} | {_rel_diff(out, model_name, config):.1e} |")  # fmt: skip
    # compile="auto" on a long planned run: the fit stops after the trial, "auto" weighs the plan.
    for model_name in [] if args.no_auto else args.models:
        rec = _fit(model_name, "auto", args.warmup + 12, args.warmup, out, "auto", planned=args.auto_steps)
        print(f"\n{model_name} compile='auto' (planned {args.auto_steps} steps): {rec['decision']}")


def _single(models: list[str], steps: int = 8) -> None:
    """The model alone (one process, one thread, no DDP, no Lightning): eager and compiled steps interleaved."""
    import torch

    torch.set_num_threads(1)
    for model_name in models:
        kwargs, batch = MODELS[model_name]
        module = _module(kwargs["kind"], batch, steps)
        x, y = next(iter(module.train_dataloader()))
        compiled = torch.compile(module.net)

        def step(net, x=x, y=y):
            started = time.perf_counter()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            return time.perf_counter() - started

        first = step(compiled)
        step(module.net)
        times = {"eager": [], "compiled": []}
        for _ in range(steps):
            times["eager"].append(step(module.net))
            times["compiled"].append(step(compiled))
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{model_name} alone: eager {ms['eager']:.1f} ms, compiled {ms['compiled']:.1f} ms per step; "
              f"compile {first - ms['compiled'] / 1e3:.1f} s")  # fmt: skip
        print(f"{model_name} alone, batch {batch}: {_gradient_parity(module, compiled, steps=10)}")


def _gradient_parity(module, compiled, steps: int) -> str:
    """Compiled against eager gradients of the same batch from the same weights, at each of ``steps`` SGD steps
    (taken with the compiled gradient, so the weights move as in a compiled run); how far two runs part when each
    follows its own gradients, the drift a fit's final weights show; and, at the first step, the same comparison in
    float64 (the same math or not) beside eager float32's own distance from float64 (float32's rounding here)."""
    import copy

    import torch

    def grads(net, x, y, params=None):
        params = list(params or module.net.parameters())
        for p in params:
            p.grad = None
        torch.nn.functional.cross_entropy(net(x), y).backward()
        return torch.cat([p.grad.flatten() for p in params])

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    start = copy.deepcopy(module.net.state_dict())
    batches = list(zip(range(steps), module.train_dataloader()))
    x, y = batches[0][1]
    net64 = copy.deepcopy(module.net).double()
    eager64 = grads(net64, x.double(), y, net64.parameters())
    compiled64 = grads(torch.compile(net64), x.double(), y, net64.parameters())
    float32 = rel(grads(module.net, x, y), eager64)
    optimizer = module.configure_optimizers()  # the fits' optimizer and lr
    per_step = []
    for _, (x, y) in batches:
        eager = grads(module.net, x, y)
        per_step.append(rel(grads(compiled, x, y), eager))
        optimizer.step()
    after = {}
    for name, net in (("eager", module.net), ("compiled", compiled)):  # each on its own gradients
        module.net.load_state_dict(start)
        optimizer = module.configure_optimizers()  # the fits' optimizer and lr
        for _, (x, y) in batches:
            grads(net, x, y)
            optimizer.step()
        after[name] = torch.cat([p.detach().flatten().clone() for p in module.net.parameters()])
    return (f"gradient vs eager at the same weights, relative: max {max(per_step):.1e} over {steps} steps "
            f"(step 1 {per_step[0]:.1e}, step {steps} {per_step[-1]:.1e}); weights after {steps} steps each on "
            f"its own gradients: {rel(after['compiled'], after['eager']):.1e}; step 1 in float64: compiled vs "
            f"eager {rel(compiled64, eager64):.1e}, while eager float32 is {float32:.1e} from eager float64")  # fmt: skip


def _paired(rows: dict, model_name: str, config: str, key: str) -> str:
    """The median over rounds of ``config``'s figure divided by the same round's eager figure, with its interval."""
    pairs = zip(rows[(model_name, config)], rows[(model_name, "eager")])
    ratios = [a[key] / b[key] for a, b in pairs if a[key] is not None and b[key]]
    if config == "eager" or len(ratios) < 2:
        return "-"
    low, high = median_interval(ratios)
    return (
        f"{statistics.median(ratios):.2f} ({low:.2f}-{high:.2f}), lower in {sum(r < 1 for r in ratios)}/{len(ratios)}"
    )


def _rel_diff(out: str, model_name: str, config: str) -> float:
    import torch

    a, b = (torch.load(os.path.join(out, f"{model_name}-{c}.pt")) for c in ("eager", config))
    return float((a - b).norm() / a.norm())


if __name__ == "__main__":
    main()
