"""``3d``: tensor parallelism on a q×q×q cube."""
