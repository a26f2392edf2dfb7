"""AutoBatchSize: the callback, its search (pure), and the memory probe."""
