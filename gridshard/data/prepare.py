"""``gridshard prepare-data``: text files or folders → a memory-mapped token file + metadata.

Output folder ``OUT``::

    tokens.bin       the token ids of every document, in input order, as uint16 (vocabulary
                     ≤ 65536) or uint32; read by ``data.kind: prepared`` with numpy.memmap
    doc_starts.npy   uint64 [documents]: the index in tokens.bin where each document starts
    tokenizer.json   the Hugging Face tokenizer (absent for the byte tokenizer)
    meta.json        tokenizer, vocab_size, token_dtype, n_tokens, documents, max_id,
                     split: {train: [0, n_train], val: [n_train, n_tokens]}, inputs, timing

A *document* is one input file (folders are walked in sorted order, hidden entries
skipped). With a BPE tokenizer every document ends with ``<|endoftext|>``.

Split: the last ``n_val = round(val_fraction · n_tokens)`` tokens are the validation part,
the rest the training part — a cut of the stream at one token position (the documents on
either side are whole except the one the cut falls in).

Streaming and parallel: each file is cut into pieces of about ``chunk_bytes`` that begin
and end at line starts (a piece owns the lines that start inside its byte range
[a, b)), so no UTF-8 character or line is split; a pool of ``workers`` processes encodes
pieces while the main process writes the finished ones in order, with at most
2·workers pieces in flight — memory stays O(workers · chunk_bytes) whatever the input
size. The BPE tokenizer is trained first on the first ``tokenizer_bytes`` of the input
(read in pieces too). With a BPE tokenizer a piece is encoded on its own, so the stream is
encode(piece₁) + encode(piece₂) + …, which differs from encoding a whole file at once only
in how a run of blank lines across a piece boundary is merged; ``decode`` of the stream
gives the input back exactly (for valid UTF-8 input).
"""
from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import sys
import time
from collections import deque
from typing import Iterator, List, Optional, Sequence

import numpy as np

from ..errors import ConfigError
# the folder's names and its readers live in .prepared_folder (tokenizer, sources read them too): importable here
from .prepared_folder import DOC_STARTS, FORMAT, META, TOKENIZER, TOKENS, open_prepared, read_meta  # noqa: F401
from .sources import _walk_files
from .tokenizer import ByteTokenizer, HFTokenizer, prepared_tokenizer, train_bpe  # noqa: F401


def input_files(inputs: Sequence[str]) -> List[str]:
    """Every regular file named or under a named folder (sorted walk, hidden entries skipped)."""
    out = []
    for path in inputs:
        if os.path.isdir(path):
            out += list(_walk_files(path, None))
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise ConfigError(f"input {path!r} does not exist. Fix: pass text files or folders of text files.")
    if not out:
        raise ConfigError(f"no input files under {list(inputs)}. Fix: pass text files or folders that hold some.")
    return out


def _line_start(fh, pos: int, size: int) -> int:
    """The first line start ≥ ``pos`` (0, or just after a ``\\n``); ``size`` if none."""
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    fh.seek(pos - 1)
    at = pos - 1
    while True:
        block = fh.read(1 << 16)
        if not block:
            return size
        i = block.find(b"\n")
        if i >= 0:
            return at + i + 1
        at += len(block)


def read_piece(path: str, a: int, b: int) -> bytes:
    """The lines of ``path`` that start in byte range [a, b) (module docstring)."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        s, e = _line_start(fh, a, size), _line_start(fh, b, size)
        fh.seek(s)
        return fh.read(max(0, e - s))


def _pieces(files: Sequence[str], chunk_bytes: int) -> Iterator[tuple]:
    for i, f in enumerate(files):
        size = os.path.getsize(f)
        for a in range(0, size, chunk_bytes):
            yield i, f, a, min(a + chunk_bytes, size)


def _text_pieces(files: Sequence[str], chunk_bytes: int, limit: int) -> Iterator[str]:
    """Text of the input, piece by piece, up to ``limit`` bytes (for tokenizer training)."""
    seen = 0
    for _, f, a, b in _pieces(files, chunk_bytes):
        yield read_piece(f, a, b).decode("utf-8", errors="replace")
        seen += b - a
        if seen >= limit:
            return


def _init_worker():
    os.environ["TOKENIZERS_PARALLELISM"] = "false"    # one core per worker


@functools.lru_cache(maxsize=1)
def _tokenizer_of(spec: Optional[str]):
    """Bytes for ``spec`` None, else the Hugging Face tokenizer whose JSON is ``spec``: a memo keyed
    by the spec and bounded to one entry (a preparation has one tokenizer), so each pool worker
    builds it once; a task carries the spec (a few MB at most, small against a piece's encoding time)."""
    if spec is None:
        return ByteTokenizer()
    from tokenizers import Tokenizer

    return HFTokenizer(Tokenizer.from_str(spec))


def _encode(task, spec: Optional[str]):
    """(file index, token ids, bytes read) of one piece encoded by the tokenizer of ``spec``."""
    i, f, a, b = task
    data, tok = read_piece(f, a, b), _tokenizer_of(spec)
    if isinstance(tok, ByteTokenizer):
        return i, np.frombuffer(data, dtype=np.uint8), b - a
    return i, np.asarray(tok.encode_bytes(data), dtype=np.int64), b - a


def _entries(out: str) -> List[str]:
    try:
        return sorted(os.listdir(out))
    except (FileNotFoundError, NotADirectoryError):
        return []


def check_out(out: str, overwrite: bool, tokenizer: str = "bytes") -> None:
    """Before any work: ``out`` is new, empty, or ``overwrite`` is given — a preparation is never
    replaced unasked — and it can be created and written. Creates nothing. The one entry allowed
    without ``overwrite`` is the ``--tokenizer`` file itself (``--tokenizer OUT/tokenizer.json``:
    a tokenizer put in the folder to prepare with)."""
    from ..fsutil import cannot_create

    own = None if tokenizer in ("bytes", "train") else os.path.abspath(tokenizer)
    held = [name for name in _entries(out) if os.path.abspath(os.path.join(out, name)) != own]
    if held and not overwrite:
        shown = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        raise ConfigError(f"--out {out!r} is not empty (it holds {shown}): prepare-data does not replace files "
                          f"unasked. Fix: pass --overwrite to replace the preparation in it (its {META}, {TOKENS}, "
                          f"{DOC_STARTS} and {TOKENIZER} go; other files stay), or choose a new or empty --out.")
    why = cannot_create(out)
    if why is not None:
        raise ConfigError(f"--out {out!r} is not writable ({why}). Fix: choose a folder you can write.")


OUTPUTS = (META, TOKENS, DOC_STARTS, TOKENIZER, TOKENS + ".tmp", META + ".tmp")
WORK_PREFIX = ".preparing-"


def _swap_in(work: str, out: str) -> None:
    """Replace the preparation in ``out`` by the finished one in ``work`` (a folder inside it):
    first the old ``meta.json`` goes — from then on ``out`` reads as "not a prepared folder" and
    training refuses it rather than mixing files — then the old preparation's other files
    (a ``tokenizer.json`` a byte preparation has no use for included), then the new files are
    renamed in, ``meta.json`` last. Each step is an atomic rename or removal on one file system;
    a reader sees the old preparation, none, or the new one complete. Other files in ``out``
    stay, and so do the work folders of other live preparations."""
    from ..parent_death import pid_alive

    for name in OUTPUTS:
        path = os.path.join(out, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            os.remove(path)
    for name in _entries(out):                         # work folders of killed preparations
        pid = name[len(WORK_PREFIX):]
        path = os.path.join(out, name)
        if name.startswith(WORK_PREFIX) and path != work and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
    for name in sorted(os.listdir(work), key=lambda n: n == META):
        os.replace(os.path.join(work, name), os.path.join(out, name))
    os.rmdir(work)


def prepare_data(inputs: Sequence[str], out: str, tokenizer: str = "bytes", vocab_size: Optional[int] = None,
                 val_fraction: float = 0.01, workers: Optional[int] = None, chunk_bytes: int = 1 << 20,
                 tokenizer_bytes: int = 256 << 20, progress: bool = True, overwrite: bool = False) -> dict:
    """Write ``out`` (module docstring); returns its metadata. ``tokenizer``: ``"bytes"``,
    ``"train"`` (a BPE of ``vocab_size`` trained on the input) or a ``tokenizer.json`` path.

    ``out`` must be new or empty unless ``overwrite`` (:func:`check_out`, before any work). The
    files are written into a work folder ``out/.preparing-<pid>`` and swapped in when complete
    (:func:`_swap_in`): an ``overwrite`` leaves no file of the old preparation behind, and a
    preparation that fails or is interrupted leaves ``out`` as it was (the work folder and any
    folders created for it are removed; a killed one leaves its work folder, which the next
    ``--overwrite`` removes)."""
    from ..fsutil import make_dirs, remove_made

    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction={val_fraction} is invalid: it is the share of tokens held out for "
                          f"validation, in [0, 1). Fix: use e.g. 0.01, or 0 for none.")
    if chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes={chunk_bytes} is invalid: it must be >= 1. Fix: use e.g. 4194304.")
    if tokenizer == "train" and vocab_size is None:
        raise ConfigError("--train-tokenizer needs --vocab-size N. Fix: add e.g. --vocab-size 4096.")
    files = input_files(inputs)
    check_out(out, overwrite, tokenizer)
    try:
        created = make_dirs(out)
        work = os.path.join(out, f"{WORK_PREFIX}{os.getpid()}")
        os.mkdir(work)
    except OSError as e:
        raise ConfigError(f"--out {out!r} is not writable ({e.strerror}). Fix: choose a folder you can write.") \
            from None
    try:
        meta = _prepare_into(work, files, inputs, tokenizer, vocab_size, val_fraction, workers, chunk_bytes,
                             tokenizer_bytes, progress)
        _swap_in(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        remove_made(created)
        raise
    return meta


def _make_tokenizer(out: str, tokenizer: str, files, vocab_size, chunk_bytes: int, tokenizer_bytes: int, progress):
    """The tokenizer to encode with: bytes, a BPE trained on the first ``tokenizer_bytes`` of the
    input, or the one read from the ``tokenizer`` file; a BPE one is saved as ``out/tokenizer.json``."""
    if tokenizer == "bytes":
        return ByteTokenizer()
    if tokenizer == "train":
        tok = train_bpe(_text_pieces(files, chunk_bytes, tokenizer_bytes), vocab_size, show_progress=progress)
    else:
        tok = HFTokenizer.from_file(tokenizer)
    tok.file = os.path.join(out, TOKENIZER)
    tok.tok.save(tok.file)
    return tok


def _encoded_pieces(files, chunk_bytes: int, spec: Optional[str], workers: int, total: int) -> Iterator[tuple]:
    """(file index, token ids, bytes read) of every piece, in input order: encoded in this process
    (one worker, or an input of one piece), else by a pool of ``workers`` processes with at most
    2·workers pieces in flight (module docstring). Either way the tokenizer is the one built from
    ``spec`` (:func:`_tokenizer_of`)."""
    tasks = _pieces(files, chunk_bytes)
    if workers == 1 or total <= chunk_bytes:
        _init_worker()
        for task in tasks:
            yield _encode(task, spec)
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_init_worker) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode, (task, spec)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _write_tokens(fh, pieces, dtype: np.dtype, eos_id: Optional[int], bar) -> tuple:
    """Write the ``pieces``' ids to ``fh`` in input order, with the end-of-text id (when the
    tokenizer has one) after each document; → (tokens written, doc_starts, largest id written)."""
    doc_starts, n, max_id, last = [], 0, -1, None
    eos = np.asarray([] if eos_id is None else [eos_id], dtype=np.int64)

    def put(ids):
        nonlocal n, max_id
        if ids.size:
            max_id = max(max_id, int(ids.max()))
            ids.astype(dtype, copy=False).tofile(fh)
            n += ids.size

    for i, ids, nbytes in pieces:
        if i != last:
            if last is not None:
                put(eos)
            doc_starts.append(n)
            last = i
        put(ids)
        bar.update(nbytes)
    if last is not None:
        put(eos)
    return n, doc_starts, max_id


def _prepare_into(out: str, files, inputs, tokenizer, vocab_size, val_fraction, workers, chunk_bytes,
                  tokenizer_bytes, progress) -> dict:
    """The preparation itself, written into the (new, empty) folder ``out``."""
    from tqdm import tqdm

    total = sum(os.path.getsize(f) for f in files)
    t0 = time.perf_counter()
    tok = _make_tokenizer(out, tokenizer, files, vocab_size, chunk_bytes, tokenizer_bytes, progress)
    dtype = np.dtype("uint16" if tok.vocab_size <= 1 << 16 else "uint32")
    spec = None if isinstance(tok, ByteTokenizer) else tok.tok.to_str()
    workers = max(1, workers or os.cpu_count() or 1)
    t_encode = time.perf_counter()
    tmp = os.path.join(out, TOKENS + ".tmp")
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress, file=sys.stderr)
    with open(tmp, "wb") as fh:
        n, doc_starts, max_id = _write_tokens(fh, _encoded_pieces(files, chunk_bytes, spec, workers, total), dtype,
                                              tok.eos_id, bar)
    bar.close()
    os.replace(tmp, os.path.join(out, TOKENS))
    np.save(os.path.join(out, DOC_STARTS), np.asarray(doc_starts, dtype=np.uint64))
    n_val = int(round(val_fraction * n))
    meta = {"format": FORMAT, "tokenizer": tok.meta(), "vocab_size": tok.vocab_size, "token_dtype": dtype.name,
            "n_tokens": n, "documents": len(doc_starts), "max_id": max_id,
            "split": {"train": [0, n - n_val], "val": [n - n_val, n]}, "val_fraction": val_fraction,
            "inputs": [os.path.abspath(p) for p in inputs], "input_bytes": total, "workers": workers,
            "seconds": time.perf_counter() - t0, "encode_seconds": time.perf_counter() - t_encode,
            "peak_rss_bytes": _peak_rss()}
    with open(os.path.join(out, META + ".tmp"), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(os.path.join(out, META + ".tmp"), os.path.join(out, META))
    return meta


def _peak_rss() -> dict:
    """Peak resident memory (bytes) of this process and of its largest finished child."""
    scale = 1 if sys.platform == "darwin" else 1024
    return {"main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
            "largest_worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale}


def check_token_ids(tokens: np.ndarray, vocab_size: int, where: str, chunk: int = 1 << 26) -> None:
    """Every id of ``tokens`` < ``vocab_size``: one vectorised pass (``chunk`` ids at a time,
    constant memory over a memmap); ConfigError naming the first bad position otherwise."""
    for a in range(0, len(tokens), chunk):
        block = np.asarray(tokens[a:a + chunk])
        if block.size and int(block.max()) >= vocab_size:
            pos = a + int(np.argmax(block >= vocab_size))
            raise ConfigError(f"{where} holds token id {int(tokens[pos])} at position {pos}, but model.vocab_size="
                              f"{vocab_size}: every id must be < vocab_size. Fix: raise model.vocab_size, check "
                              f"data.token_dtype, or prepare the data again with the model's tokenizer.")
