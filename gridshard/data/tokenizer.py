"""Tokenizers of prepared data: gridshard's byte-level one and Hugging Face ``tokenizers`` BPE.

* :class:`ByteTokenizer`: id = byte value, vocabulary 256, lossless for any input
  (``decode`` replaces invalid UTF-8 with U+FFFD). No package needed.
* :class:`HFTokenizer`: a ``tokenizers.Tokenizer`` read from a ``tokenizer.json`` (an
  existing one, or one :func:`train_bpe` wrote). Needs ``pip install -e .[data]``.

:func:`train_bpe` trains a byte-level BPE on an iterator of text pieces (streaming: the
trainer keeps word counts, never the text): the 256 byte symbols are the initial alphabet, so
every input is encodable and ``decode(encode(text)) == text``; one special token
``<|endoftext|>`` (id 0) separates documents in the token stream.

A prepared folder names its tokenizer in ``meta.json``; :func:`prepared_tokenizer` rebuilds it.
"""
from __future__ import annotations

import os
from typing import Iterable, List, Optional

from ..errors import ConfigError, need_package
from .prepared_folder import read_meta

EOS = "<|endoftext|>"


def _need_tokenizers():
    return need_package("tokenizers", "Hugging Face `tokenizers` is not installed: BPE tokenizers need it. Fix: "
                        "pip install -e .[data] (or use the built-in byte tokenizer: --bytes).")


class ByteTokenizer:
    """Bytes as ids 0..255 (no special tokens)."""

    kind = "bytes"
    vocab_size = 256
    eos_id: Optional[int] = None

    def encode_bytes(self, data: bytes) -> List[int]:
        return list(data)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def meta(self) -> dict:
        return {"kind": "bytes"}


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (``tokenizer.json``); ``eos_id`` is ``<|endoftext|>``'s id or None."""

    kind = "hf"

    def __init__(self, tok, file: Optional[str] = None):
        self.tok, self.file = tok, file
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = tok.token_to_id(EOS)

    @classmethod
    def from_file(cls, path: str) -> "HFTokenizer":
        tokenizers = _need_tokenizers()
        if not os.path.isfile(path):
            raise ConfigError(f"tokenizer file {path!r} does not exist. Fix: pass the path of a Hugging Face "
                              f"tokenizer.json, or --train-tokenizer / --bytes.")
        try:
            return cls(tokenizers.Tokenizer.from_file(path), path)
        except Exception as e:      # tokenizers raises its own Exception type for a bad file
            raise ConfigError(f"{path!r} is not a Hugging Face tokenizer.json ({e}). Fix: pass a tokenizer.json "
                              f"saved by `tokenizers`/`transformers`.") from None

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_bytes(self, data: bytes) -> List[int]:
        return self.encode(data.decode("utf-8", errors="replace"))

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def meta(self) -> dict:
        return {"kind": "hf", "file": os.path.basename(self.file) if self.file else None, "eos_id": self.eos_id}


def train_bpe(pieces: Iterable[str], vocab_size: int, show_progress: bool = False) -> HFTokenizer:
    """A byte-level BPE with ``vocab_size`` entries at most (fewer when the text has fewer
    merges), ``<|endoftext|>`` = id 0, trained on ``pieces`` (module docstring)."""
    tokenizers = _need_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ConfigError(f"--vocab-size={vocab_size} is too small: a byte-level BPE needs the {len(alphabet)} byte "
                          f"symbols and {EOS}. Fix: use --vocab-size {len(alphabet) + 1} or more (e.g. 4096).")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=alphabet,
                                  show_progress=show_progress)
    tok.train_from_iterator(pieces, trainer=trainer)
    return HFTokenizer(tok)


def prepared_tokenizer(folder: str):
    """The tokenizer of the prepared folder ``folder`` (the one its ``meta.json`` names)."""
    spec = read_meta(folder, check_tokens=False)["tokenizer"]
    if spec["kind"] == "bytes":
        return ByteTokenizer()
    return HFTokenizer.from_file(os.path.join(folder, spec["file"]))


def run_tokenizer(config: dict, folder: str):
    """The tokenizer the run trained with: bytes for ``stdlib``/``text``; for ``prepared`` the
    copy in the run directory (``RUN_DIR/tokenizer``) or else the data folder itself."""
    data = config["data"]
    if data["kind"] in ("stdlib", "text"):
        return ByteTokenizer()
    if data["kind"] == "prepared":
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(folder)))
        for candidate in (os.path.join(run_dir, "tokenizer"), data["path"]):
            if os.path.isfile(os.path.join(candidate, "meta.json")):
                return prepared_tokenizer(candidate)
        raise ConfigError(f"the run's tokenizer is gone: neither {os.path.join(run_dir, 'tokenizer')!r} nor "
                          f"data.path={data['path']!r} holds meta.json. Fix: run from the folder the run was "
                          f"trained in, or restore the prepared data folder.")
    raise ConfigError(f"the run trained on data.kind={data['kind']} (raw token ids): gridshard does not know their "
                      f"tokenizer. Fix: train on `gridshard prepare-data` output (data.kind=prepared).")
