"""Diagnostics: pure checks and measurements and the callbacks that feed them; they name library settings
(``DataLoader(num_workers=...)``), which the runner maps to its config keys. Map: docs/design.md."""
