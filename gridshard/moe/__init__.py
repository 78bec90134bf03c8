"""Mixture-of-Experts: the router and its load balancing (:mod:`.routing`), the experts as
grouped products (:mod:`.experts`) and the block that replaces a decoder MLP (:mod:`.layer`)."""
