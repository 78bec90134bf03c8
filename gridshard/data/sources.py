"""Token sources with no download: Python's own standard library, user text, token files.

* ``stdlib``: the bytes of the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
  (site-packages excluded), walked in sorted order and joined by ``\\n`` until
  ``max_bytes``; byte vocabulary 0..255. Deterministic on one Python installation.
* ``text``: one file, or every regular file under a folder (sorted, hidden entries
  skipped), as bytes, capped at ``max_bytes``.
* ``tokens``: a flat binary file of ``uint16``/``uint32`` token ids, read lazily with
  ``numpy.memmap`` (nothing is loaded until a batch touches it; no cap).
* ``prepared``: a folder written by ``gridshard prepare-data`` (:mod:`gridshard.data.prepare`):
  its ``tokens.bin`` as a memmap; vocabulary, dtype and train/validation split from ``meta.json``
  (read by :mod:`gridshard.data.prepared_folder`).

Every source is a 1-D numpy array of token ids. :func:`load_split` cuts it into the training
and validation parts (``data.val_fraction`` / ``data.val_path``, :func:`split_sizes`).
"""
from __future__ import annotations

import os
import sysconfig
from typing import Iterator, Optional

import numpy as np

from ..errors import ConfigError
from .prepared_folder import memmap_tokens, open_prepared, read_meta


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _walk_files(root: str, suffix: Optional[str]) -> Iterator[str]:
    """Regular files under ``root`` in sorted order (dirs sorted too), skipping hidden
    entries, ``site-packages``/``dist-packages`` and ``__pycache__``."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith(".") or (suffix and not name.endswith(suffix)):
                continue
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                yield path


def _files_for(kind: str, path: Optional[str]) -> list:
    """The files of a ``stdlib`` or ``text`` source (ConfigError for a ``text`` path that does not exist)."""
    if kind == "stdlib":
        return list(_walk_files(stdlib_root(), ".py"))
    _check_exists(path, kind)
    if os.path.isdir(path):
        return list(_walk_files(path, None))
    return [path]


def _check_exists(path: str, kind: str):
    if not os.path.exists(path):
        raise ConfigError(f"data.path={path!r} does not exist: data.kind={kind} reads it. "
                          f"Fix: point data.path at an existing {'file' if kind == 'tokens' else 'file or folder'}.")


def read_bytes_corpus(kind: str, path: Optional[str], max_bytes: int) -> np.ndarray:
    """The capped byte corpus of a ``stdlib`` or ``text`` source as ``uint8``."""
    out, total = bytearray(), 0
    for f in _files_for(kind, path):
        with open(f, "rb") as fh:
            chunk = fh.read(max_bytes - total)
        out += chunk
        total += len(chunk)
        if total < max_bytes:
            out += b"\n"
            total += 1
        if total >= max_bytes:
            break
    return np.frombuffer(bytes(out[:max_bytes]), dtype=np.uint8)


def token_file_length(path: str, token_dtype: str) -> int:
    """Tokens in a flat token file; ConfigError if it is missing or its size is not whole tokens."""
    _check_exists(path, "tokens")
    if not os.path.isfile(path):
        raise ConfigError(f"data.path={path!r} is not a file: data.kind=tokens reads one flat binary file. "
                          f"Fix: point data.path at the token file, or use data.kind=text for a folder.")
    itemsize = np.dtype(token_dtype).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise ConfigError(f"data.path={path!r} has {size} bytes, not a multiple of {itemsize} "
                          f"(data.token_dtype={token_dtype}). Fix: set data.token_dtype to the dtype the file "
                          f"was written with.")
    return size // itemsize


def source_size_tokens(kind: str, path: Optional[str], token_dtype: str, max_bytes: int) -> int:
    """Number of tokens the source yields, from file sizes only (cheap; used by validation)."""
    if kind == "tokens":
        return token_file_length(path, token_dtype)
    total = 0
    for f in _files_for(kind, path):
        total += os.path.getsize(f) + 1
        if total >= max_bytes:
            return max_bytes
    return total


def load_tokens(kind: str, path: Optional[str] = None, token_dtype: str = "uint16",
                max_bytes: int = 4 << 20) -> np.ndarray:
    """The 1-D token array of a source (see the module docstring)."""
    if kind == "tokens":
        return memmap_tokens(path, token_dtype, token_file_length(path, token_dtype))
    if kind == "prepared":
        return open_prepared(path)
    return read_bytes_corpus(kind, path, max_bytes)


def _cut(n: int, data) -> Optional[int]:
    """Index where the validation part starts in a source of ``n`` tokens, or None (no
    validation part). ``data``: the config's data section (module docstring of the config)."""
    if data.val_path is not None:
        return None
    if data.val_fraction is None and data.kind == "prepared":
        start = read_meta(data.path)["split"]["val"][0]
        return start if start < n else None
    n_val = int(round((data.val_fraction or 0.0) * n))
    return n - n_val if n_val else None


def split_sizes(data) -> tuple:
    """(training tokens, validation tokens or 0) of the config's data section, from file sizes
    and metadata only (for validation before anything is read)."""
    def size(path):
        if data.kind == "prepared":
            return read_meta(path)["n_tokens"]
        return source_size_tokens(data.kind, path, data.token_dtype, data.max_bytes)

    n = size(data.path)
    if data.val_path is not None:
        return n, size(data.val_path)
    cut = _cut(n, data)
    return (n, 0) if cut is None else (cut, n - cut)


def load_split(data) -> tuple:
    """(training tokens, validation tokens or None) of the config's data section: the source's
    last ``round(val_fraction · n)`` tokens are the validation part (a prepared folder's own
    split when ``val_fraction`` is null), or ``val_path`` — the same kind of source — is."""
    tokens = load_tokens(data.kind, data.path, data.token_dtype, data.max_bytes)
    if data.val_path is not None:
        return tokens, load_tokens(data.kind, data.val_path, data.token_dtype, data.max_bytes)
    cut = _cut(len(tokens), data)
    return (tokens, None) if cut is None else (tokens[:cut], tokens[cut:])
