"""``none``: no tensor parallelism (:mod:`gridshard.tensor.replicated.scheme`)."""
