"""What everything uses and that uses nothing above it: decisions, argument checks, ranks, RNG states, the batch size, CPU malloc tuning."""
