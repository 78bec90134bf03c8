"""Training data: download-free token sources and layout-independent batch sharding."""
from .batches import BatchPlan, rank_rows, step_offsets, windows
from .sources import load_split, load_tokens, read_bytes_corpus, source_size_tokens, split_sizes, stdlib_root

__all__ = ["BatchPlan", "rank_rows", "step_offsets", "windows", "load_tokens", "read_bytes_corpus",
           "source_size_tokens", "stdlib_root", "load_split", "split_sizes"]
