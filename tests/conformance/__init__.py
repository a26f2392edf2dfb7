"""The conformance corpus: SoloDDP() against stock DDPStrategy on ordinary Lightning code (issue 26)."""
