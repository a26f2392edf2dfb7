"""Diagnostics of a running fit, measured on every rank:

- :mod:`~lightning_solo.diagnostics.timing`: one rank's time split (data wait, forward+backward, optimizer,
  exposed communication from DDP's reducer) per optimizer step;
- :mod:`~lightning_solo.diagnostics.verdict`: the pure verdict, measured times → bound and ranked remedies;
- :mod:`~lightning_solo.diagnostics.report`: the ranks' sums gathered, throughput, straggler, table, JSON;
- :mod:`~lightning_solo.diagnostics.chart`: ``doctor.png``.

:class:`lightning_solo.callbacks.TrainingDoctor` drives them during ``fit``.
"""
