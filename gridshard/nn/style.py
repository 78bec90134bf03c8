"""Compatibility shim: ``plain_linear`` now lives in :mod:`gridshard.nn.plain`.

This module remains only so that the benchmarks, which still import
``gridshard.nn.style.plain_linear``, keep working until they move to
``gridshard.nn.plain``; it will then be deleted. Nothing else belongs here: models are
laid out by :func:`gridshard.parallelize`.
"""
from .plain import plain_linear

__all__ = ["plain_linear"]
