"""Diagnostics: pure checks and measurements, apart from the callbacks that gather their inputs.

``finding`` (Finding: one problem and its fix) · ``collectives`` (gather objects / rows from every rank) ·
``facts`` (what each rank reports about itself) · ``agreement`` (the ranks' facts compared) · ``launch_env`` (the launcher's variables, the backend) ·
``setup_checks`` (loader and model warnings) · ``loss_watch`` (loss trend, spikes, rank spread) ·
``resources`` (CPU, RSS, GPU samples).
"""
