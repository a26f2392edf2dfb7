"""``python -m lightning_solo.evaluate``: the command; the code is :mod:`lightning_solo.app.evaluate`."""

from lightning_solo.app.evaluate import main

if __name__ == "__main__":
    main()
