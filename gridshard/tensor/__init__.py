"""The tensor modes, one folder each, registered as schemes (:mod:`gridshard.tensor_scheme`).

=============  =========================================================================
folder         mode
=============  =========================================================================
replicated/    ``none``: every weight whole on each rank (T = 1)
tp1d/          ``1d``: Megatron column/row split, optional sequence parallelism
tp2d/          ``2d``: SUMMA on a q×q grid
tp2p5d/        ``2.5d``: d depth layers of a q×q grid (each layer runs 2D)
tp3d/          ``3d``: a q×q×q cube
=============  =========================================================================

Importing this package registers them, in this order (the order error messages list them in).
"""
from ..tensor_scheme import register_tensor_scheme
from .replicated.scheme import ReplicatedScheme
from .tp1d.scheme import OneDScheme
from .tp2d.scheme import TwoDScheme
from .tp2p5d.scheme import TwoP5DScheme
from .tp3d.scheme import ThreeDScheme

for _scheme in (ReplicatedScheme(), OneDScheme(), TwoDScheme(), TwoP5DScheme(), ThreeDScheme()):
    register_tensor_scheme(_scheme)

__all__ = ["ReplicatedScheme", "OneDScheme", "TwoDScheme", "TwoP5DScheme", "ThreeDScheme"]
