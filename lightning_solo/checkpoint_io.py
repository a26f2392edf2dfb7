"""Compatibility module: the checkpoint code lives in :mod:`lightning_solo.checkpoint` (``io``, ``manifest``,
``select``). Its public names stay importable from here."""

from lightning_solo.checkpoint import *  # noqa: F403
from lightning_solo.checkpoint import __all__  # noqa: F401
