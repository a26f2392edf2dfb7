"""Diagnostics: pure checks and measurements, apart from the callbacks that gather their inputs.

Checks (Preflight, LossWatch): ``finding`` (Finding: one problem and its fix) · ``collectives`` (gather objects /
rows from every rank) · ``facts`` (what each rank reports about itself) · ``agreement`` (the ranks' facts
compared) · ``launch_env`` (the launcher's variables, the backend) · ``setup_checks`` (loader and model
warnings) · ``loss_watch`` (loss trend, spikes, rank spread) · ``resources`` (CPU, RSS, GPU samples).

Measurements (TrainingDoctor, measured on every rank):

- :mod:`~lightning_solo.diagnostics.doctor.timing`: one rank's time split (data wait, forward+backward, optimizer,
  exposed communication from DDP's reducer) per optimizer step;
- :mod:`~lightning_solo.diagnostics.doctor.verdict`: the pure verdict, measured times → bound and ranked remedies;
- :mod:`~lightning_solo.diagnostics.doctor.report`: the ranks' sums gathered, throughput, straggler, table, JSON;
- :mod:`~lightning_solo.diagnostics.doctor.chart`: ``doctor.png``.
"""
