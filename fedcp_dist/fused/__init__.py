"""Many clients in one step: a group of a rank's clients trained at once on stacked parameters.
The fused step, the Step protocol's operations on (k, B, ...) tensors (step); the scheduler that
keeps its slots full (slots); the grouped layers (forward); the memory a slot takes (memory);
which clients train together, and a rank's groups side by side on its threads (groups).
"""
