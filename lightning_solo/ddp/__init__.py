"""SoloDDP and its components: the unused-parameter policy, gradient communication, SyncBN, precision, exact resume, evaluation, SIGTERM agreement, uneven data, launchers."""
