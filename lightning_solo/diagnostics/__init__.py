"""Diagnostics: pure checks and measurements and the callbacks that feed them. Map: docs/design.md."""
