"""The compatibility boundary: every private Lightning or torch name the pack relies on goes through
:mod:`~lightning_solo._compat.lightning` or :mod:`~lightning_solo._compat.torch`, one accessor per name, each with
the versions it was checked on. ``tests/test_compat.py`` asserts that every one of them exists, so an upstream
release that moves one fails there, by name, rather than somewhere inside a fit."""
