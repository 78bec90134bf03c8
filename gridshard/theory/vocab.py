"""Vocabulary padding: the one rule every vocab-parallel layer and formula shares."""


def padded_vocab_size(vocab: int, parts: int) -> int:
    """V_p = ⌈V/n⌉·n: the vocabulary rounded up to a multiple of the ``parts`` it is split
    into (T in 1D, q in 2D). The padding rows are zero, never looked up and never targeted;
    they exist only in local storage, never in the canonical tensor."""
    return -(-vocab // parts) * parts
