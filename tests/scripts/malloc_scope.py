"""glibc's malloc after SoloDDP's setting and the auto-batch-size memory probe, in a fresh process (glibc as a
user's process starts; ``MALLOC_*`` variables are only read then).

    python tests/scripts/malloc_scope.py off|on     # cpu_malloc.decide(reuse=False|True), then a probe session

Prints one JSON object: the ``cpu_malloc`` decision, and what glibc does after the probe session (and, with
``on``, after :func:`lightning_solo.core.cpu_malloc.restore` too), observed by :mod:`tests.helpers.glibc_malloc`.
"""

import json
import sys
import warnings
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_solo.callbacks.batch_size.probe import MemoryProbe
from lightning_solo.core import cpu_malloc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers
from tests.helpers import glibc_malloc  # after the path insert above


class Wide(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)  # outside a fit: the session's own warning filter, not the process's
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


def observe() -> dict:
    return {
        "mapped_256k": glibc_malloc.mapped(256 * 1024),
        "mapped_4m": glibc_malloc.mapped(4 * 2**20),
        "trims": glibc_malloc.trims(),
    }


def main(mode: str) -> None:
    record = {"decision": cpu_malloc.decide(reuse=mode == "on").as_dict()}
    filters = len(warnings.filters)
    module = Wide()
    probe = MemoryProbe(torch.device("cpu"), cap_bytes=2**30)
    with probe.session(module, None):
        record["measured"] = [
            probe.measure(module, Precision(), (torch.randn(n, 512), torch.randint(0, 2, (n,)))) for n in (64, 256)
        ]
    record["filters_kept"] = len(warnings.filters) == filters
    record["after_probe"] = observe()
    record["adaptive"] = glibc_malloc.adaptive()  # last: it raises an adaptive threshold
    if mode == "on":
        record["restored"] = cpu_malloc.restore()
        record["after_restore"] = observe()
    print(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
