"""WarmupScaledLR: the callback, its schedule math, its param-group handling, and its plot."""
