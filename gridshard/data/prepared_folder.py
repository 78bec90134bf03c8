"""A prepared data folder as readers see it: its file names, format tag, ``meta.json`` and the
token stream (``gridshard prepare-data`` writes it, :mod:`gridshard.data.prepare` has the layout).

A leaf of :mod:`gridshard.data`: the writer (:mod:`.prepare`), the token sources
(:mod:`.sources`, ``data.kind: prepared``) and the tokenizers (:mod:`.tokenizer`, a prepared
folder's tokenizer) all read a folder through this module, and it imports none of them.
"""
from __future__ import annotations

import json
import os

import numpy as np

from ..errors import ConfigError

__all__ = ["DOC_STARTS", "FORMAT", "META", "TOKENIZER", "TOKENS", "memmap_tokens", "open_prepared", "read_meta"]

META, TOKENS, DOC_STARTS, TOKENIZER = "meta.json", "tokens.bin", "doc_starts.npy", "tokenizer.json"
FORMAT = "gridshard-prepared-1"


def read_meta(folder: str, check_tokens: bool = True) -> dict:
    """``meta.json`` of a prepared folder; ConfigError if it is not one (or, with
    ``check_tokens``, if tokens.bin's size disagrees with it)."""
    path = os.path.join(folder, META)
    if not os.path.isfile(path):
        raise ConfigError(f"data.path={folder!r} is not a prepared data folder (no {META}). Fix: create it with "
                          f"`gridshard prepare-data INPUT... --out {folder}`.")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} has format {meta.get('format')!r}, not {FORMAT!r}. Fix: prepare the data again "
                          f"with this gridshard version.")
    if not check_tokens:
        return meta
    size = os.path.getsize(os.path.join(folder, TOKENS)) if os.path.isfile(os.path.join(folder, TOKENS)) else -1
    if size != meta["n_tokens"] * np.dtype(meta["token_dtype"]).itemsize:
        raise ConfigError(f"{os.path.join(folder, TOKENS)} has {size} bytes but {META} says {meta['n_tokens']} "
                          f"{meta['token_dtype']} tokens (an interrupted or edited preparation). Fix: run "
                          f"`gridshard prepare-data` again.")
    return meta


def memmap_tokens(path: str, token_dtype: str, n_tokens: int) -> np.ndarray:
    """A read-only memmap of the ``n_tokens`` ids of a flat token file (numpy cannot map an empty one)."""
    return np.memmap(path, dtype=token_dtype, mode="r") if n_tokens else np.zeros(0, dtype=token_dtype)


def open_prepared(folder: str) -> np.ndarray:
    """The read-only memmap of a prepared folder's whole token stream."""
    meta = read_meta(folder)
    return memmap_tokens(os.path.join(folder, TOKENS), meta["token_dtype"], meta["n_tokens"])
