"""Every private upstream name the pack relies on still exists (lightning_solo._compat: one accessor per name,
checked on lightning 2.6.6 and torch 2.14.1, and on lightning 2.6.0 with torch 2.11.0). An upstream release that
moves one fails here, by name."""

from __future__ import annotations

import inspect
import signal
from datetime import timedelta

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose
from lightning.pytorch.utilities import CombinedLoader
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo._compat import patch
from lightning_solo._compat import torch as torch_compat

ACCESSOR_MODULES = (lightning_compat, torch_compat)


def _accessors():
    for module in ACCESSOR_MODULES:
        for name, value in vars(module).items():
            if inspect.isfunction(value) and value.__module__ == module.__name__:
                yield module, name, value


@pytest.mark.parametrize(("module", "name", "accessor"), list(_accessors()), ids=lambda v: getattr(v, "__name__", v))
def test_every_accessor_says_the_versions_it_was_checked_on(module, name, accessor):
    assert accessor.__doc__ and "checked on" in accessor.__doc__, f"{module.__name__}.{name}"


@pytest.mark.parametrize(
    ("owner", "name"), [(cls, n) for cls, names in lightning_compat.OVERRIDDEN.items() for n in names]
)
def test_overridden_lightning_methods_exist(owner, name):
    assert hasattr(owner, name), f"{owner.__name__}.{name} is gone: SoloDDP/SoloCheckpoint/SoloLauncher override it"


def test_ddp_strategy_attributes_exist():
    strategy = DDPStrategy()
    missing = [n for n in lightning_compat.STRATEGY_ATTRIBUTES if not hasattr(strategy, n)]
    assert not missing
    assert hasattr(DDPStrategy, "process_group_backend")  # the public name, used instead of the private one


def test_lightning_reads_exist():
    import lightning as L

    logger = CSVLogger("unused")
    assert all(hasattr(logger, n) for n in lightning_compat.LOGGER_ATTRIBUTES)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    connector = lightning_compat.logger_connector(trainer)
    assert all(isinstance(getattr(connector, n), dict) for n in lightning_compat.LOGGER_CONNECTOR_METRICS)
    assert isinstance(lightning_compat.should_update_logs(trainer), bool)
    assert lightning_compat.attached_trainer(L.LightningModule()) is None
    assert lightning_compat.precision_flags(trainer, "default")[0] == "32-true"
    assert hasattr(trainer.fit_loop, "_data_source") and lightning_compat.fit_data_source(trainer) is None
    trainer.fit_loop._combined_loader = CombinedLoader([[1], [2, 3]], mode="max_size_cycle")
    assert lightning_compat.combined_loader_mode(trainer) == "max_size_cycle"
    assert hasattr(trainer._checkpoint_connector, "_ckpt_path")
    assert callable(trainer._checkpoint_connector.dump_checkpoint)
    assert lightning_compat.is_local_path("/tmp/x.ckpt") and not lightning_compat.is_local_path("s3://b/x.ckpt")
    assert lightning_compat.hpc_save_path(trainer).endswith("hpc_ckpt_1.ckpt")
    assert lightning_compat.lightning_owns_requeue_signal(trainer, signal.SIGUSR1) is False
    handler = trainer._signal_connector._slurm_sigusr_handler_fn
    previous = signal.signal(signal.SIGUSR1, _HandlersCompose([handler]))
    try:
        assert lightning_compat.lightning_owns_requeue_signal(trainer, signal.SIGUSR1) is True
    finally:
        signal.signal(signal.SIGUSR1, previous)
    err = RuntimeError("Expected to have finished reduction")
    lightning_compat.augment_message(err, ".*finished reduction.*", "explained")
    assert "explained" in str(err)


def test_the_logged_sample_count_is_told_from_other_reduced_tensors():
    # A sync_dist epoch mean: Lightning's _ResultMetric reduces its value, then its integer sample count.
    import sys

    import torch
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

    seen = []

    def reduce(tensor, reduce_op=None, group=None):
        seen.append((tensor.dtype, lightning_compat.logged_sample_count(sys._getframe(1), tensor)))
        return tensor

    meta = _Metadata(fx="training_step", name="loss", on_step=False, on_epoch=True, reduce_fx="mean")
    meta.sync = _Sync(_should=True, fn=reduce, _op="mean")
    metric = _ResultMetric(meta, is_tensor=True)
    metric.update(torch.tensor(2.0), batch_size=3)
    assert float(metric.compute()) == 2.0
    assert seen == [(torch.float32, False), (torch.int64, True)]
    assert lightning_compat.logged_sample_count(sys._getframe(), torch.tensor(3)) is False


def test_eval_loader_accessors_work():
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    class Loader(DataLoader):  # a subclass: re-made the way Lightning injects its sampler
        pass

    batches = BatchSampler(SequentialSampler(range(5)), batch_size=2, drop_last=False)
    wrapped = _IndexBatchSamplerWrapper(batches)  # as Lightning's predict loop wraps a batch sampler
    assert lightning_compat.inner_batch_sampler(wrapped) is batches
    assert lightning_compat.inner_batch_sampler(batches) is batches
    assert [list(b) for b in wrapped] == [[0, 1], [2, 3], [4]] and wrapped.seen_batch_indices == [
        [0, 1],
        [2, 3],
        [4],
    ]
    args, kwargs = lightning_compat.dataloader_init_args(Loader(list(range(5)), batch_size=2, num_workers=0))
    kwargs.update(sampler=None, batch_sampler=batches, batch_size=1, shuffle=False, drop_last=False)
    remade = lightning_compat.reinstantiate(Loader(list(range(5))), args, kwargs)
    assert type(remade) is Loader and [b.tolist() for b in remade] == [[0, 1], [2, 3], [4]]


def test_torch_names_exist():
    for name in (
        "_get_ddp_logging_data",
        "_set_ddp_runtime_logging_sample_rate",
        "_remove_autograd_hooks",
        "_set_params_and_buffers_to_ignore_for_model",
    ):
        assert hasattr(DistributedDataParallel, name), name
    reducer = torch.distributed.Reducer
    for name in ("_get_local_used_map", "_autograd_hook", "_ddp_graph_static"):
        assert hasattr(reducer, name), name
    assert callable(torch.distributed.distributed_c10d._get_default_store)  # torch_compat.default_store
    assert callable(torch.distributed.Store.clone)  # the watchdog's own connection to that store
    assert callable(powerSGD_hook._should_compress) and callable(default_hooks._compress_hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert torch_compat.scaler_scale(scaler) is None and torch_compat.scaler_init_scale(scaler) == 8.0
    assert torch_compat.should_compress(64, 64, 1, 2.0) is True
    module = torch.nn.Linear(2, 2)
    module.register_parameter("extra", torch.nn.Parameter(torch.zeros(1)))
    torch_compat.unregister_parameter(module, "extra")
    assert "extra" not in dict(module.named_parameters())
    torch_compat.set_params_to_ignore(module, ["weight"])
    assert getattr(module, torch_compat.DDP_IGNORE_LIST) == ["weight"]


def test_dataloader_reinstantiation():
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4, shuffle=False)
    sampler = torch.utils.data.SequentialSampler(range(6))
    args, kwargs = lightning_compat.dataloader_init_args(loader, sampler)
    rebuilt = lightning_compat.reinstantiate(loader, args, {**kwargs, "dataset": list(range(6))})
    assert rebuilt.sampler is sampler and [b.tolist() for b in rebuilt] == [[0, 1, 2, 3], [4, 5]]


def test_ddp_timing_keys_exist_and_the_sample_rate_applies():
    import torch.distributed as dist

    from lightning_solo.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ddp = DistributedDataParallel(torch.nn.Linear(2, 1))
    torch_compat.set_ddp_runtime_logging_sample_rate(ddp, 1)
    for _ in range(3):
        ddp(torch.ones(1, 2)).sum().backward()
    data = torch_compat.ddp_logging_data(ddp)
    assert all(key in data for key in torch_compat.DDP_TIMING_KEYS), sorted(data)
    assert data["iteration"] == 2  # iterations 1 and 2 timed so far (each is read at the next forward)
    hooked = DistributedDataParallel(torch.nn.Linear(2, 1))
    lightning_compat.register_ddp_comm_hook(hooked, ddp_comm_hook=default_hooks.fp16_compress_hook)
    hooked(torch.ones(1, 2)).sum().backward()
    assert torch_compat.ddp_logging_data(hooked)["comm_hook"] == "fp16_compress_hook"
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    torch_compat.set_group_timeout(timedelta(seconds=7), group)
    assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=7)


def test_compile_names_exist():
    from lightning.pytorch.utilities.compile import from_compiled, to_uncompiled

    from tests.helpers.modules import TinyModule

    module = TinyModule()
    assert not lightning_compat.compiled_by_user(module)
    from_compiled(torch.compile(module, backend="eager"))
    assert lightning_compat.compiled_by_user(module)
    to_uncompiled(module)
    assert not lightning_compat.compiled_by_user(module)
    counters = torch_compat.dynamo_counters()
    assert {"total", "ok"} >= set(counters["frames"]) and isinstance(counters["unimplemented"], dict)
    assert torch_compat.optimize_ddp() in (True, False, "ddp_optimizer", "python_reducer",
                                           "python_reducer_without_compiled_forward", "no_optimization")  # fmt: skip
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert torch_compat.is_compiled_module(compiled) and not torch_compat.is_compiled_module(torch.nn.Linear(2, 2))
    assert getattr(compiled, torch_compat.COMPILED_CHILD) is compiled._orig_mod
    holder = torch.nn.Module()
    holder.net = compiled
    assert list(holder.state_dict()) == [
        f"net.{torch_compat.COMPILED_CHILD}.weight",
        f"net.{torch_compat.COMPILED_CHILD}.bias",
    ]


_FR_SCRIPT = """
import json, torch, torch.distributed as dist
from lightning_solo._compat import torch as torch_compat
from lightning_solo.testing import free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
dist.all_reduce(torch.ones(2))
print(json.dumps({"gloo": json.loads(torch_compat.flight_recorder_json(False)),
                  "nccl": json.loads(torch_compat.flight_recorder_json(True)) if dist.is_nccl_available() else None}))
"""


def test_flight_recorder_dumps_have_the_fields_the_watchdog_reads():
    # A fresh process: torch reads TORCH_FR_BUFFER_SIZE once, at its recorder's first use.
    import json
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "8", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _FR_SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    dumps = json.loads(out.stdout.strip().splitlines()[-1])
    (entry,) = dumps["gloo"]["entries"]  # _dump_fr_trace_json
    assert entry["profiling_name"] == "gloo:all_reduce" and entry["process_group"] == ["0", "default_pg"]
    assert {"collective_seq_id", "p2p_seq_id", "is_p2p", "state", "retired", "record_id"} <= set(entry)
    if dumps["nccl"] is not None:  # _dump_nccl_trace_json: no NCCL group here, so no entries
        assert "version" in dumps["nccl"] and not dumps["nccl"].get("entries")


def test_the_watchdogs_stack_reading_names_exist():
    from torch.utils.data import DataLoader

    codes = lightning_compat.hook_call_codes()
    assert len(codes) == 3 and all(c.co_varnames[1] == "hook_name" for c in codes)
    assert torch_compat.dataloader_next_code().co_name == "__next__"
    assert {c.co_name for c in torch_compat.dataloader_start_codes()} == {
        "__iter__",
        "_get_iterator",
        "__init__",
    }
    iterator = iter(DataLoader([1, 2, 3]))
    assert torch_compat.batches_yielded(iterator) == 0
    next(iterator)
    assert torch_compat.batches_yielded(iterator) == 1 and torch_compat.batches_yielded(object()) is None


@pytest.mark.parametrize(("owner", "name"), [(o, n) for o, names in patch.PATCHED.items() for n in names])
def test_patched_upstream_names_exist(owner, name):
    assert hasattr(owner, name), f"{getattr(owner, '__name__', owner)}.{name} is gone: the pack replaces it at run time"


def test_patches_undo_instance_class_module_and_class_changes_newest_first():
    class Base:
        def hello(self):
            return "base"

    class Other(Base):
        pass

    obj, module = Base(), torch.nn
    original_linear = module.Linear
    with patch.Patches() as patches:
        patches.set(obj, "hello", lambda: "instance")
        patches.set(Base, "hello", lambda self: "class")
        patches.set(Other, "hello", lambda self: "inherited")
        patches.set(module, "Linear", None)
        patches.set(obj, "__class__", Other)
        patches.set(obj, "hello", lambda: "again")  # a second patch of one name undoes to the first
        assert (obj.hello(), type(obj), module.Linear) == ("again", Other, None)
    assert (obj.hello(), type(obj), module.Linear) == ("base", Base, original_linear)
    assert "hello" not in vars(Other) and "hello" not in vars(obj)


def test_patched_is_undone_when_the_block_raises():
    loader = torch.utils.data.DataLoader([1, 2])

    def fail_inside():
        with patch.patched(loader, "_get_iterator", None):
            assert loader._get_iterator is None
            raise RuntimeError

    with pytest.raises(RuntimeError):
        fail_inside()
    assert "_get_iterator" not in vars(loader) and list(loader) == [torch.tensor([1]), torch.tensor([2])]
