"""``python -m lightning_solo.export``: the command; the code is :mod:`lightning_solo.app.export`."""

import sys

from lightning_solo.app.export import main

if __name__ == "__main__":
    sys.exit(main())
