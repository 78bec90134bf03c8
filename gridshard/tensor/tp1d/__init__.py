"""``1d``: Megatron column/row tensor parallelism with optional sequence parallelism."""
