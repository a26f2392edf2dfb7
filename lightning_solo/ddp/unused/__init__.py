"""``find_unused_parameters="auto"``: the policy, its evidence window, the exact fast path, what the search cannot see, and DDP re-wrapping."""
