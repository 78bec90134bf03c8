"""The tokenizer files of a Hugging Face export: ``tokenizer.json``, ``tokenizer_config.json``
and ``special_tokens_map.json`` next to the weights, so that
``transformers.AutoTokenizer.from_pretrained(OUT)`` gives the run's own tokenizer.

Which tokenizer the run trained with (the same rule as ``gridshard generate``,
:func:`gridshard.data.tokenizer.run_tokenizer`):

* ``data.kind`` ``stdlib`` / ``text``: gridshard's byte tokenizer
  (:class:`gridshard.data.tokenizer.ByteTokenizer`: id = byte value, 256 ids, no special
  tokens — the vocabulary stays 256 even when ``model.vocab_size`` is larger; the model's
  extra rows are never produced by it);
* ``prepared``: the prepared folder's ``tokenizer.json`` (the run's copy
  ``RUN_DIR/tokenizer/`` first), copied byte for byte; a prepared folder of the byte
  tokenizer gets the byte tokenizer's file;
* ``tokens``: raw ids of an unknown tokenizer — nothing is written, and export says so.

The byte tokenizer as a ``tokenizers.Tokenizer``. ``tokenizers`` works on Unicode strings,
so byte-level tokenizers (GPT-2's scheme, ``pre_tokenizers.ByteLevel``) first map each byte
b of the UTF-8 text to one printable character c(b): the printable Latin-1 bytes
(``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) map to themselves, the other 68 bytes in
increasing order to U+0100, U+0101, … (:func:`byte_symbols`; its 256 characters are
exactly ``ByteLevel.alphabet()``, asserted when building). The exported model is a BPE
whose vocabulary is {c(b): b} and which has no merges, so every byte symbol stays one token
and its id is the byte value: ``encode(text).ids == list(text.encode("utf-8"))``. The
pre-tokenizer is ``ByteLevel(add_prefix_space=False, use_regex=False)`` (no space added in
front, no splitting into words, which a merge-free BPE would not need anyway); the decoder
``decoders.ByteLevel`` maps the symbols back to bytes and decodes UTF-8 replacing each
invalid sequence by U+FFFD, as ``ByteTokenizer.decode`` does (``errors="replace"``; both
replace maximal invalid subparts — tested on broken sequences).

``tokenizers`` is optional (``pip install -e .[data]``): without it the weights are still
exported and one line says that the tokenizer was not written and how to get it.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Callable, List

from ..errors import ConfigError

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


def _note(line: str) -> None:
    print(f"gridshard export: {line}", file=sys.stderr)


def byte_symbols() -> dict:
    """byte value → its one-character symbol in byte-level BPE (module docstring)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | \
        set(range(ord("®"), ord("ÿ") + 1))
    others = iter(range(256, 512))                  # U+0100, U+0101, … in increasing byte order
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


def byte_tokenizer():
    """A ``tokenizers.Tokenizer`` equal to :class:`~gridshard.data.tokenizer.ByteTokenizer`
    (module docstring). ImportError without ``tokenizers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = byte_symbols()
    assert set(symbols.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in symbols.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_tokenizer_files(out_dir: str, run_tokenizer, max_len: int) -> List[str]:
    """``tokenizer.json`` (the run's file, or the byte tokenizer's), ``tokenizer_config.json``
    and ``special_tokens_map.json`` in ``out_dir``; returns their paths. ``run_tokenizer``: a
    :class:`~gridshard.data.tokenizer.ByteTokenizer` or ``HFTokenizer``. ImportError when the
    byte tokenizer's file needs ``tokenizers`` and it is missing."""
    path = os.path.join(out_dir, TOKENIZER)
    if getattr(run_tokenizer, "kind", None) == "hf" and run_tokenizer.file:
        shutil.copyfile(run_tokenizer.file, path)
        from ..data.tokenizer import EOS

        special = {"eos_token": EOS} if run_tokenizer.eos_id is not None else {}
    else:
        byte_tokenizer().save(path)
        special = {}
    # PreTrainedTokenizerFast over tokenizer.json; no cleanup of spaces around punctuation
    # (it would change decode), no special tokens added by encode (the run's never were)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": int(max_len), "add_bos_token": False, "add_eos_token": False, **special}
    paths = [path]
    for name, obj in ((TOKENIZER_CONFIG, config), (SPECIAL_TOKENS_MAP, special)):
        paths.append(os.path.join(out_dir, name))
        with open(paths[-1], "w") as f:
            json.dump(obj, f, indent=1)
    return paths


def export_tokenizer(config: dict, folder: str, out_dir: str, note: Callable[[str], None] = _note) -> List[str]:
    """The tokenizer files of the run whose resolved ``config`` wrote checkpoint ``folder``,
    in ``out_dir`` (module docstring); their paths, or [] after one ``note`` line saying why
    none was written (raw token ids, no ``tokenizers`` package, the run's tokenizer gone)."""
    kind = config.get("data", {}).get("kind")
    if kind == "tokens":
        note("no tokenizer written: the run trained on raw token ids (data.kind=tokens), whose tokenizer gridshard "
             "does not know. Fix: copy that tokenizer's tokenizer.json next to the weights, or train on "
             "`gridshard prepare-data` output (data.kind=prepared).")
        return []
    from ..data.tokenizer import run_tokenizer

    try:
        tok = run_tokenizer(config, folder)
        return write_tokenizer_files(out_dir, tok, config.get("model", {}).get("max_seq_len") or 0)
    except ImportError:
        note("no tokenizer written: the optional `tokenizers` package is not installed (the weights and "
             "config.json are). Fix: pip install -e .[data] and export again.")
    except ConfigError as e:
        note(f"no tokenizer written: {e}")
    return []


__all__ = ["byte_symbols", "byte_tokenizer", "write_tokenizer_files", "export_tokenizer"]
