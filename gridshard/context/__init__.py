"""Context parallelism: the sequence itself split over a context axis of C ranks.

* :mod:`.sequence_split`: the load-balanced split (rank i holds chunks i and 2C − 1 − i) and the
  global token positions rotary embeddings read;
* :mod:`.ring_attention`: causal attention whose key/value blocks travel around the ring, merged
  by their log-sum-exp;
* :mod:`.all_to_all`: attention on whole sequences for a group of heads, sequence traded for
  heads by all-to-alls before and after it.
"""
from .all_to_all import all_to_all_attention
from .ring_attention import ring_attention
from .sequence_split import global_positions, shard_sequence, unshard_sequence

__all__ = ["all_to_all_attention", "global_positions", "ring_attention", "shard_sequence", "unshard_sequence"]
