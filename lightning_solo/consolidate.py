"""``python -m lightning_solo.consolidate``: the command; the code is :mod:`lightning_solo.fsdp.consolidate`."""

import sys

from lightning_solo.fsdp.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
