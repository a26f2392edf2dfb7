"""Diagnostics: pure checks and measurements (``checks/``, ``doctor/``, ``loss_trend``, ``resources``) and the
callbacks that feed them (Preflight, LossWatch, ResourceMonitor, ProfilerWindow, TrainingDoctor). They name
library settings (``DataLoader(num_workers=...)``); the runner maps those to its config keys
(:mod:`lightning_solo.app.remedies`). The map of the package is docs/design.md."""
