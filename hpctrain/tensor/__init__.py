"""Tensor parallelism on the grid's `tensor` axis (framework-free shard layout and the
activation collectives; the framework ops live in backends/)."""
