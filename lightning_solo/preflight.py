"""``python -m lightning_solo.preflight``: the command; the code is :mod:`lightning_solo.app.preflight`."""

import sys

from lightning_solo.app.preflight.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
