"""Checks of SoloDDP's process group, launchers, precision, re-wrap, communication hooks, resume and preflight."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from benchmarks.gpu_checks.common import (
    accelerator,
    fit_solo,
    join_as_rank,
    one_rank_group,
    regression_loader,
    rel_err,
    two_ranks,
)
from benchmarks.gpu_checks.harness import ROOT, child_env
from lightning_solo import SoloDDP
from lightning_solo.testing import free_port


def check_nccl1(device: str) -> tuple[bool, str]:
    """``SoloDDP()`` on one GPU: an nccl group of world size 1, its monitored barrier (a gloo side group) and a
    CUDA all-reduce inside the fit."""
    seen: dict = {}

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_end(self):
            seen["backend"] = dist.get_backend()
            seen["world"] = dist.get_world_size()
            self.trainer.strategy.barrier("gpu_check")  # the monitored barrier, on its group
            total = torch.ones(1, device=self.device)
            dist.all_reduce(total)
            seen["all_reduce"] = total.item()

    trainer = fit_solo(device, Probe(), regression_loader(), steps=3)
    decisions = trainer.strategy.decisions
    want = "nccl" if device == "cuda" else "gloo"
    ok = (
        seen.get("backend") == want
        and seen.get("world") == 1
        and seen.get("all_reduce") == 1.0
        and decisions["process_group_backend"].value == want
        and trainer.global_step == 3
    )
    barrier = decisions.get("barrier")
    return ok, (
        f"backend {seen.get('backend')}, world size {seen.get('world')}, all-reduce {seen.get('all_reduce')}; "
        f"barrier = {barrier.value!r} ({barrier.reason[:80]})"
        if barrier
        else f"seen {seen}; no barrier decision"
    )


def check_scaler(device: str) -> tuple[bool, str]:
    """``16-mixed`` on the device: a step whose loss is made inf overflows; the GradScaler skips it (weights
    unchanged), halves the scale and counts it."""
    overflow_at = 3
    trace: list[tuple[torch.Tensor, float]] = []

    class Overflowing(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]).float(), batch[1])
            return loss * float("inf") if batch_idx == overflow_at else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            scaler = self.trainer.precision_plugin.scaler
            trace.append((torch.cat([p.detach().flatten().cpu() for p in self.parameters()]), scaler.get_scale()))

    trainer = fit_solo(device, Overflowing(), regression_loader(), steps=6, precision="16-mixed")
    plugin = trainer.precision_plugin
    params, scales = [t[0] for t in trace], [t[1] for t in trace]
    skipped_held = torch.equal(params[overflow_at], params[overflow_at - 1])
    others_moved = all(not torch.equal(params[i], params[i - 1]) for i in range(1, len(params)) if i != overflow_at)
    backed_off = scales[overflow_at] == scales[overflow_at - 1] * plugin.scaler_settings.get("backoff_factor", 0.5)
    scaler_device = plugin.scaler._scale.device.type if plugin.scaler._scale is not None else None
    ok = skipped_held and others_moved and backed_off and plugin.skipped_steps == 1 and scaler_device == device
    return ok, (
        f"step {overflow_at} overflowed: weights held {skipped_held}, other steps moved {others_moved}; "
        f"scale {scales[overflow_at - 1]:g} -> {scales[overflow_at]:g}; skipped_steps {plugin.skipped_steps}; "
        f"scale on {scaler_device}"
    )


def check_rng(device: str) -> tuple[bool, str]:
    """``resume.rng_state()`` / ``set_rng_state()`` bring the current device's CUDA generator back."""
    from lightning_solo.ddp.resume import record as resume

    if device == "cuda":
        torch.cuda.set_device(0)
        torch.randn(1, device="cuda")  # CUDA initialised: its generator is part of the state
    state = resume.rng_state()
    first = torch.randn(4, device=device), torch.randn(4)
    resume.set_rng_state(state)
    again = torch.randn(4, device=device), torch.randn(4)
    same = all(torch.equal(a, b) for a, b in zip(first, again))
    cuda = state.get("cuda")
    held = f"{len(cuda)} CUDA generator state(s)" if isinstance(cuda, (list, tuple)) else type(cuda).__name__
    return same, f"draws after restore identical: {same}; saved: {held}"


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).float().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _tiny_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)


def check_fork(device: str) -> tuple[bool | None, str]:
    """In a process that has used CUDA (a notebook after a cell touched it), ``SoloDDP(start_method="fork")``
    refuses before forking, naming CUDA."""
    if device != "cuda":
        return None, "needs CUDA"
    torch.zeros(1, device="cuda")  # what a notebook cell does before fit
    try:
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork"), max_steps=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
        trainer.fit(_Tiny(), _tiny_loader())
    except Exception as err:  # noqa: BLE001 - what the user would see
        refused = f"refused: {type(err).__name__}: {err}"
        return "CUDA" in refused and "Cannot re-initialize" not in refused, refused[:300]
    return False, "not refused: the fit forked after CUDA was initialised"


def check_flight_recorder(device: str) -> tuple[bool, str]:
    """A one-rank group (nccl on CUDA), three collectives, then this rank's flight-recorder record dumped (torch's
    JSON, as the watchdog dumps it at a hang) and parsed: the last collective, its number and nothing in flight."""
    import json
    import time

    from lightning_solo._compat.torch import flight_recorder_json
    from lightning_solo.ddp.watchdog.flight_recorder import TRACE_BUFFER_SIZE, clause, summarize

    nccl = device == "cuda"
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # the older name too: whichever torch reads
    env = {name: str(TRACE_BUFFER_SIZE) for name in names if name not in os.environ}
    os.environ.update(env)  # before the group (read once); gone after, for the bundle's next checks
    with one_rank_group(device), contextlib.ExitStack() as restore:
        restore.callback(lambda: [os.environ.pop(name) for name in env])
        x = torch.ones(4, device=device)
        for _ in range(2):
            dist.all_reduce(x)
        dist.broadcast(x, 0)
        if nccl:
            torch.cuda.synchronize()
        deadline = time.monotonic() + 10
        while True:  # NCCL's watchdog thread marks completion a moment after the kernels end
            dump = flight_recorder_json(nccl)
            summary = summarize(dump)
            pending = any(last["pending"] for last in summary.values())
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    entries = json.loads(dump).get("entries", [])
    last = next(iter(summary.values()), None)
    words = clause({0: summary}) or ""
    ok = last is not None and "broadcast" in last["op"] and last["seq"] >= 3 and not pending
    ok = ok and words.startswith("flight recorder: nothing in flight")
    return ok, f"{'nccl' if nccl else 'gloo'}: {len(entries)} entries, {len(dump)} B; last {last}; {words}"


def check_notebook(device: str) -> tuple[bool, str]:
    """Two fork-launched 16-mixed fits in this one process, as two notebook cells: CUDA stays uninitialised
    here (the forked ranks use it), so the second fork works too."""
    devices = 1 if device == "cuda" else 2
    model, seen = _Tiny(), []
    for _ in range(2):
        before = model.layer.weight.detach().clone()
        trainer = L.Trainer(accelerator=accelerator(device), devices=devices, precision="16-mixed",
                            strategy=SoloDDP(start_method="fork"), max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(model, _tiny_loader())
        moved = not torch.equal(model.layer.weight.detach().cpu(), before.cpu())
        seen.append((trainer.global_step, moved, torch.cuda.is_initialized()))
    ok = all(step == 2 and moved and not cuda for step, moved, cuda in seen)
    return ok, "; ".join(
        f"fit {i + 1}: {step} steps, weights back in the parent {moved}, CUDA initialised here {cuda}"
        for i, (step, moved, cuda) in enumerate(seen)
    )


# Cycles torch.cuda._sleep spins before each optimizer step: ~20 ms, so the step's kernels queue behind it.
_SLEEP_CYCLES = 40_000_000


class _Branchy(L.LightningModule):
    """Every branch used in the evidence window (re-wrap to the fast path at step 4), then rank 1 skips the
    branch every other step from step 10 (completed exactly, re-wrap to True at the next step)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.branch, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        self.memory: dict[int, int] = {}  # allocated at each step's start
        self.peak_before = 0  # steps 0-3, before the first re-wrap

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.trunk(x))
        if not (self.global_rank == 1 and batch_idx >= 10 and batch_idx % 2):
            h = h + self.branch(h)
        return nn.functional.mse_loss(self.head(h), y)

    def on_train_batch_start(self, batch, batch_idx):
        if self.device.type == "cuda":
            self.memory[batch_idx] = torch.cuda.memory_allocated()
            if batch_idx == 4:  # the peak from here on spans both re-wraps
                self.peak_before = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()

    def on_before_optimizer_step(self, optimizer):
        if self.device.type == "cuda":  # a full queue: the re-wrap may come while this step still runs
            torch.cuda._sleep(_SLEEP_CYCLES)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def rewrap_rank(device: str, rank: str, port: str, out: str) -> None:
    """One of two ranks, started as an external process (the way torchrun/SLURM start them)."""
    join_as_rank(rank, port)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 4, generator=g))
    model, steps = _Branchy(), 40 if device == "cuda" else 16  # re-wraps at steps 4 and 11
    trainer = L.Trainer(accelerator=accelerator(device), devices=1, num_nodes=2, max_steps=steps,
                        strategy=SoloDDP(start_method="popen", process_group_backend="gloo"), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=8))
    flat = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    decision = trainer.strategy.decisions["find_unused_parameters"]
    memory = {}
    if device == "cuda":
        memory = {
            "before": model.memory[4],
            "after": model.memory[steps - 1],
            "peak_before": model.peak_before,
            "peak_after": torch.cuda.max_memory_allocated(),
        }
    saved = {"params": flat, "find_unused": decision.value, "reason": decision.reason, "memory": memory}
    torch.save(saved, f"{out}/rank{rank}.pt")


def check_rewrap(device: str) -> tuple[bool, str]:
    """2 processes on the one GPU (gloo: NCCL refuses two ranks on one device), re-wrapping DDP twice while
    the previous optimizer step is still queued: replicas bit-identical, no memory kept by the old wrappers."""
    with tempfile.TemporaryDirectory() as out:
        failed = two_ranks("rewrap-rank", rewrap_rank, device, out)
        if failed:
            return False, failed
        r0, r1 = (torch.load(f"{out}/rank{r}.pt", weights_only=True) for r in (0, 1))
    identical = torch.equal(r0["params"], r1["params"])
    rewrapped = all(r["find_unused"] is True and "switched" in r["reason"] for r in (r0, r1))
    detail = (
        f"find_unused_parameters={r0['find_unused']!r} ({r0['reason'][-90:]}); replicas bit-identical: "
        f"{identical} (max diff {(r0['params'] - r1['params']).abs().max().item():.3g})"
    )
    kept = True
    if r0["memory"]:  # a wrapper kept alive keeps at least its gradient buckets: the parameters' bytes
        buckets = r0["params"].numel() * 4
        grown = max(m["after"] - m["before"] for m in (r0["memory"], r1["memory"]))
        peak_grown = max(m["peak_after"] - m["peak_before"] for m in (r0["memory"], r1["memory"]))
        kept = grown < buckets and peak_grown < buckets
        m = r0["memory"]
        detail += (
            f"; rank 0 allocated {m['before']} -> {m['after']} B, max_memory_allocated {m['peak_before']} -> "
            f"{m['peak_after']} B across the re-wraps (most grown on a rank: {grown} / {peak_grown} B, bound "
            f"{buckets} B); {_SLEEP_CYCLES:.0e} sleep cycles before each optimizer step"
        )
    return identical and rewrapped and kept, detail


def _comm_net(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)


def _flat_grad(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def check_comm(device: str) -> tuple[bool, str]:
    """The hooks on a one-rank group (nccl on CUDA): fp16/bf16 against the exact gradient, and PowerSGD trained
    6 steps straight against 3 + its state saved (error feedback shard beside the checkpoint) + a fresh DDP and
    hook loading it + 3: the same parameters."""
    from lightning_solo.ddp.comm.hooks import CommHook

    def batch(step: int) -> torch.Tensor:
        return torch.randn(6, 8, generator=torch.Generator().manual_seed(step)).to(device)

    def start(name, state=None, weights=None, ckpt=None):
        net = _comm_net(device)
        if weights is not None:
            net.load_state_dict(weights)
        ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.001)  # several buckets
        hook = CommHook(name, powersgd_start_iter=2)
        hook.load_state_dict(state, ckpt)
        hook.register(ddp)
        return net, ddp, hook, torch.optim.SGD(ddp.parameters(), lr=0.1)

    def train(ddp, opt, steps):
        for step in steps:
            opt.zero_grad()
            ddp(batch(step)).pow(2).sum().backward()
            opt.step()

    def flat(net):
        return torch.cat([p.detach().flatten() for p in net.parameters()])

    errors = {}
    with one_rank_group(device), tempfile.TemporaryDirectory() as tmp:
        for name in ("fp16", "bf16"):
            net, ddp, _, _ = start(name)
            ref = _comm_net(device)
            ddp(batch(0)).pow(2).sum().backward()
            ref(batch(0)).pow(2).sum().backward()
            errors[name] = rel_err(_flat_grad(net), _flat_grad(ref))
        net, ddp, hook, opt = start("powersgd")
        train(ddp, opt, range(6))
        straight = flat(net)
        net, ddp, hook, opt = start("powersgd")
        train(ddp, opt, range(3))
        ckpt = str(Path(tmp) / "comm.ckpt")
        saved = [hook.state_dict(ckpt), net.state_dict()]
        net, ddp, hook, opt = start("powersgd", *saved, ckpt=ckpt)
        train(ddp, opt, range(3, 6))
        resumed_iter = hook.state_dict()["iter"]
        diff = rel_err(flat(net), straight)
    ok = errors["fp16"] <= 2e-3 and errors["bf16"] <= 2e-2 and diff <= 1e-6 and resumed_iter == 6
    backend = "nccl" if device == "cuda" else "gloo"
    return ok, (
        f"one-rank {backend}: gradient rel. err fp16 {errors['fp16']:.2g}, bf16 {errors['bf16']:.2g}; PowerSGD "
        f"3 + resume + 3 vs 6 straight: rel. diff {diff:.2g}, iter {resumed_iter}"
    )


class _Indexed(Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        return torch.randn(8, generator=torch.Generator().manual_seed(i)), i


class _Crash(Exception):
    pass


class _Dropout(L.LightningModule):
    """Dropout drawn on the device, momentum, a shuffled loader; raises before step ``crash_at``."""

    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.3), nn.Linear(64, 1))
        self.crash_at, self.seen = crash_at, []

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.crash_at:
            raise _Crash(f"simulated crash before step {self.crash_at + 1}")

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[1].tolist())
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(_Indexed(), batch_size=4, shuffle=True)


def check_resume(device: str) -> tuple[bool, str]:
    """Crash mid-epoch (step 7 of 12 per epoch), resume from the newest checkpoint: the same samples in the same
    order and the same parameters as the uninterrupted run, dropout drawn on the device."""
    from lightning_solo.callbacks import SoloCheckpoint
    from lightning_solo.checkpoint import resolve_ckpt_path

    steps, crash_at = 16, 7

    def fit(run: Path, crash_at=None, resume=None) -> _Dropout:
        L.seed_everything(1234, verbose=False)
        model = _Dropout(crash_at)
        checkpoint = SoloCheckpoint(dirpath=run / "ckpt", every_n_train_steps=1, keep_last_k=2)
        trainer = L.Trainer(accelerator=accelerator(device), devices=1, strategy=SoloDDP(), max_steps=steps,
                            callbacks=[checkpoint], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
        with contextlib.suppress(_Crash):  # the crashed run's checkpoints stay
            trainer.fit(model, ckpt_path=resolve_ckpt_path(resume, run / "ckpt"))
        model.decisions = trainer.strategy.decisions
        return model

    with tempfile.TemporaryDirectory() as tmp:
        reference = fit(Path(tmp) / "reference")
        crashed = fit(Path(tmp) / "run", crash_at=crash_at)
        resumed = fit(Path(tmp) / "run", resume="auto")
    order = crashed.seen + resumed.seen == reference.seen
    diff = max(rel_err(a, b) for a, b in zip(resumed.parameters(), reference.parameters()))
    mid = resumed.decisions.get("mid_epoch_resume")
    ok = order and diff <= 1e-6 and mid is not None and mid.value == crash_at
    return ok, (
        f"crash before step {crash_at + 1}, resumed: sample order identical {order}, parameters rel. diff "
        f"{diff:.2g}; mid_epoch_resume = {mid.value if mid else None!r}"
    )


def check_preflight(device: str) -> tuple[bool, str]:
    """``python -m lightning_solo.preflight`` as rank 0 of 1 with LOCAL_RANK=1 (past a one-GPU machine's GPUs):
    a finding, not a crash."""
    env = {**child_env(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "lightning_solo.preflight"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    out = proc.stdout + proc.stderr
    finding = next((line.strip() for line in out.splitlines() if "[env.LOCAL_RANK]" in line), None)
    ok = proc.returncode in (0, 2) and finding is not None and "Traceback" not in out
    return ok, f"exit {proc.returncode}; " + (finding or f"no LOCAL_RANK finding; output tail: {out[-400:]}")


def check_compile(device: str) -> tuple[bool, str]:
    """``SoloDDP(compile=True)`` on the one device (inductor on CUDA; ``aot_eager`` on CPU, where inductor's C++
    build is not the point): compiled inside DDP's forward, no fallback to eager, no recompile over the fit, and
    the weights after 6 steps within 1e-4 (relative) of the eager fit's."""

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8))

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    compiled_setting = True if device == "cuda" else {"backend": "aot_eager"}
    weights = {}
    for setting in (False, compiled_setting):
        module = Probe()
        trainer = fit_solo(device, module, regression_loader(), steps=6, compile=setting)
        weights[bool(setting)] = torch.nn.utils.parameters_to_vector(module.parameters()).detach().cpu()
    decisions = trainer.strategy.decisions
    compiled = decisions["compile"]
    rel = float((weights[True] - weights[False]).norm() / weights[False].norm())
    fallback = decisions.get("compile_fallback")
    ok = (
        bool(compiled.value)
        and "inside DDP's forward" in compiled.reason
        and "0 recompiles" in compiled.reason
        and fallback is None
        and rel <= 1e-4
    )
    return ok, f"weights vs eager {rel:.1e}; {compiled.reason.rsplit(';', 1)[-1].strip()}" + (
        f"; {fallback.reason[:80]}" if fallback else ""
    )
