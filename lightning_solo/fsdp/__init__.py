"""SoloFSDP (FSDP2 applied by the strategy), its sharded checkpoints, and their consolidation into one file."""
