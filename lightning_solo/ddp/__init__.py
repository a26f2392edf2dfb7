"""SoloDDP and its components: unused parameters, gradient communication, SyncBN, precision, exact resume,
evaluation, SIGTERM agreement, uneven data, launchers."""
