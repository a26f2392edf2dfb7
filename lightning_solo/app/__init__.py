"""The Hydra application: the runner, evaluate, export, config checks, the run summary, run-directory agreement, pre-launch checks, data and models."""
