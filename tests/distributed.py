"""The tests' way to start N ranks: :func:`lightning_solo.testing.run_ranks` (raw torch.distributed).
Tests that go through Lightning use ``SoloDDP(start_method="fork")``, which launches its own processes."""

from lightning_solo.testing import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
