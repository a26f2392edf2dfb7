"""No host sync per step from the pack: what :class:`~lightning_solo.testing.HostSyncRecorder` counts on the CPU
(the ops that stall the host on a GPU), and the count per training step under the runner's default config."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import hydra
import lightning as L
import pytest
import torch

from lightning_solo._compat import torch as torch_compat
from lightning_solo.app.run import instantiate_group, make_trainer
from lightning_solo.app.run_summary import RunSummary
from lightning_solo.diagnostics.doctor.training_doctor import decide_sample_rate
from lightning_solo.testing import HostSyncRecorder
from tests.helpers import composed


def _events(work) -> list[tuple[str, str]]:
    model = torch.nn.Linear(3, 2)
    recorder = HostSyncRecorder().watch(model)
    host = torch.tensor([1.0])  # a tensor the code keeps on the host on purpose (a gloo flag, say)
    with recorder:
        work(model, host)
    return [(e.kind, e.op) for e in recorder.events]


@pytest.mark.parametrize(
    ("work", "expected"),
    [
        (lambda m, h: m(torch.ones(1, 3)).sum().item(), [("read", "item")]),
        (lambda m, h: float(m.weight.sum()), [("read", "__float__")]),
        (lambda m, h: bool((m.weight > 0).any()), [("read", "__bool__")]),
        (lambda m, h: m.weight.tolist(), [("read", "tolist")]),
        (lambda m, h: m.weight.cpu().sum().item(), [("read", "cpu")]),  # the host copy is the host's
        (lambda m, h: m.weight.to("cpu"), [("read", "to('cpu')")]),
        (lambda m, h: m.weight.to("cpu", torch.int32).tolist(), [("read", "to('cpu')")]),  # then the host's
        (lambda m, h: m.weight.nonzero(), [("read", "aten::nonzero")]),
        (lambda m, h: h.copy_(m.bias[:1]), [("read", "aten::copy_")]),
        (lambda m, h: h.copy_(m.bias[:1], non_blocking=True), []),  # into pinned memory: the host goes on
        (lambda m, h: torch.tensor(0.5, device=m.weight.device), [("upload", "torch.tensor(..., device=)")]),
        (lambda m, h: h.to(m.weight.device), [("upload", "to(device)")]),
        (lambda m, h: m.bias.detach()[:1].copy_(h), [("upload", "aten::copy_")]),
        # What stays on one side: device compute, device factories, host values.
        (lambda m, h: m(torch.ones(4, 3)).square().mean().backward(), []),
        (lambda m, h: torch.zeros((), device=m.weight.device) + m.weight.sum(), []),
        (lambda m, h: (h.item(), float(h), h.tolist(), torch.tensor([2.0]) + h), []),
        (lambda m, h: m.weight.to(m.weight.device), []),
    ],
)
def test_recorder_counts_what_would_stall_the_host_on_a_gpu(work, expected):
    assert _events(work) == expected


def test_recorder_without_watch_counts_every_tensor_as_the_devices():
    with HostSyncRecorder() as recorder:
        torch.ones(2).sum().item()
    assert recorder.syncs == ["item"]


@pytest.mark.parametrize(("requested", "device", "rate"), [(None, "cpu", 1), (None, "cuda", 100), (5, "cuda", 5)])
def test_training_doctor_leaves_ddps_sample_rate_on_cuda(requested, device, rate):
    # DDP's CUDA timer waits on its events at each sampled iteration: the doctor samples no more often there.
    assert decide_sample_rate(requested, torch.device(device)).value == rate


class _RecordSyncs(L.Callback):
    """The recorder over the fit, each event tagged with the training batch it happened in; one file per rank."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        progress = trainer.fit_loop.epoch_loop.batch_progress.total
        self.recorder = HostSyncRecorder(trainer.strategy.root_device, step=lambda: progress.ready - 1)
        self.recorder.watch(pl_module).__enter__()

    def on_train_end(self, trainer, pl_module):
        self.recorder.__exit__(None, None, None)
        events = [[e.step, e.kind, e.op, e.site] for e in self.recorder.events]
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(events))
        # DDP's own count of the bytes it found unused (sampled every step by TrainingDoctor on the CPU): any
        # makes its reducer copy the usage map to the host, a blocking copy on a GPU the recorder cannot see.
        unused = torch_compat.ddp_logging_data(trainer.strategy.model).get("unused_parameter_size", 0)
        (self.out / f"unused{trainer.global_rank}.json").write_text(json.dumps(unused))


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("case", "extra"),
    [
        pytest.param("fast_path", [], id="fast_path"),  # digits' 32 per device: BatchNorm as it is
        pytest.param("syncbn", ["data.batch_size=16"], id="syncbn_auto"),  # 16 per device: SyncBN, True
    ],
)
def test_no_host_sync_on_the_steps_nothing_is_logged_under_the_runners_defaults(tmp_path, case, extra):
    every, steps, measuring = 4, 18, 8
    overrides = [
        "++parallelism.strategy.start_method=fork",
        f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={every}",
        "trainer.max_epochs=1",
        "trainer.limit_val_batches=2",
        "data.num_workers=1",
        *extra,
    ]
    with composed(overrides, tmp_path) as cfg:
        datamodule = hydra.utils.instantiate(cfg.data)
        model = hydra.utils.instantiate(cfg.model)
        callbacks = [*instantiate_group(cfg.callbacks), RunSummary(), _RecordSyncs(tmp_path)]
        trainer = make_trainer(cfg, callbacks)
        trainer.fit(model, datamodule)
    decisions = trainer.strategy.decisions
    assert decisions["sync_batchnorm"].value is (case == "syncbn")
    assert decisions["find_unused_parameters"].value is (case == "syncbn")  # True with SyncBN, else the fast path
    logging = {i for i in range(steps) if (i + 1) % every == 0}
    # The first batches measure once (the unused-parameter window and its re-wrap, ResourceMonitor's pace, which
    # then samples and logs every ~30 s) and the last one ends the fit (report, checkpoint): between them, a batch
    # the loggers do not write reads nothing from the device.
    quiet = set(range(measuring, steps - 1)) - logging
    for rank in range(2):
        events = json.loads((tmp_path / f"rank{rank}.json").read_text())
        table = Counter(f"{kind} {op} at {site}" for step, kind, op, site in events if step in quiet)
        assert not table, f"rank {rank}: host syncs on batches nothing is logged at:\n" + "\n".join(
            f"{n:4d}× {line}" for line, n in table.most_common()
        )
        assert json.loads((tmp_path / f"unused{rank}.json").read_text()) == 0  # the window's probe is gone
        # The recorder sees what the logging batches read: the logged lr, the bar's loss.
        logged = {(e[1], e[3].rsplit("/", 1)[-1].split(":")[0]) for e in events if e[0] in logging}
        assert {("upload", "module.py"), ("read", "progress_bar.py")} <= logged or rank == 1
