"""Exact mid-epoch resume: the record a checkpoint carries and the resumable training loader."""
