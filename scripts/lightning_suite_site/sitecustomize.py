"""The SoloDDP swap of ``scripts/lightning_suite.py`` in every Python process of the swapped pass.

Lightning's ``ddp_spawn`` tests start fresh interpreters that re-import the test modules to unpickle what they
run: a test class defined as ``class TestDDPSpawnStrategy(DDPStrategy)`` would be built on the stock class there
while the parent built it on ``SoloDDP``. ``lightning_suite_plugin`` puts this folder on ``PYTHONPATH`` and sets
``LIGHTNING_SUITE_SWAP=1`` for the swapped pass only; in each process it starts, the swap is then made just
before the first ``tests_pytorch`` module is imported, as in the pytest process itself. Without that variable
this file does nothing.
"""

import os
import sys

if os.environ.get("LIGHTNING_SUITE_SWAP") == "1":

    class _SwapBeforeTests:
        """A meta-path finder that finds nothing: it only makes the swap before ``tests_pytorch`` loads."""

        done = False

        def find_spec(self, fullname, path=None, target=None):
            if not self.done and (fullname == "tests_pytorch" or fullname.startswith("tests_pytorch.")):
                self.done = True
                import lightning_suite_plugin

                lightning_suite_plugin.swap_in_solo_ddp()
            return None

    sys.meta_path.insert(0, _SwapBeforeTests())
