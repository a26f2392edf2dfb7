"""``python -m lightning_solo.run``: the command; the code is :mod:`lightning_solo.app.run`."""

from lightning_solo.app.run import main

if __name__ == "__main__":
    main()
