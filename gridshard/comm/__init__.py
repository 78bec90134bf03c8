"""Communication: recorded collectives, the ledger, and dual autograd functions."""
from .ledger import LEDGER, CommLedger, ring_wire_bytes, use_ledger
from .dual_ops import (copy_to_group, reduce_from_group, scatter_to_group, gather_from_group,
                       gather_sequence, reduce_scatter_sequence)

__all__ = ["LEDGER", "CommLedger", "use_ledger", "ring_wire_bytes", "copy_to_group", "reduce_from_group",
           "scatter_to_group", "gather_from_group", "gather_sequence", "reduce_scatter_sequence"]
