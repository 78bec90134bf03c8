"""Record sources: Hugging Face ``datasets`` on local files (``data.kind: hf``) and chat records
(``data.kind: chat``), each record one document, tokenised when a rank needs it.

``data.path`` is one of (nothing is downloaded, no network is needed):

* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``load_from_disk``);
* a folder of data files (``load_dataset(folder)``: parquet, json/jsonl, csv, arrow, txt);
* one data file, its builder chosen by its suffix (:data:`BUILDERS`).

``data.hf_split`` picks the split (a single data file has only ``train``), ``data.hf_streaming``
reads it as an ``IterableDataset`` (records arrive in order as they are read; nothing is converted
or cached) instead of a memory-mapped ``Dataset`` (random access). Needs ``pip install -e .[data]``.

The records are an **endless sequence**: record i is the dataset's record i mod n (epochs follow
each other in the same order). :meth:`RecordSource.records` yields them from any index: a
``Dataset`` reads record i directly, a stream reads (and skips) its way there.

A record becomes (token ids, trained flags): ``hf``, its ``data.hf_text_field`` encoded with the
run's tokenizer (``data.tokenizer``: a ``tokenizer.json`` or a tokenizer folder, else bytes) and the end-of-document id
appended (``data.eod_token``, else the tokenizer's ``<|endoftext|>``; bytes have none: record
boundaries are known anyway), every target trained; ``chat``, its ``messages`` rendered by
:func:`gridshard.data.chat.render`, only the assistant's tokens trained.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import numpy as np

from ..errors import ConfigError, need_package

BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow",
            ".txt": "text"}


def _datasets():
    return need_package("datasets", "Hugging Face `datasets` is not installed: data.kind=hf/chat reads datasets with "
                        "it. Fix: pip install -e .[data]")


def open_dataset(path: str, split: str, streaming: bool):
    """The split ``split`` of the local dataset at ``path`` (module docstring); ConfigError naming
    the path, the split and the splits there are."""
    datasets = _datasets()
    if not path or not os.path.exists(path):
        raise ConfigError(f"data.path={path!r} does not exist: data.kind=hf/chat reads a local dataset. Fix: point "
                          f"data.path at a saved dataset folder, a folder of data files or one data file.")
    saved = os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                        for f in ("dataset_info.json", "dataset_dict.json", "state.json"))
    try:
        if saved:
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise KeyError(split)
                ds = ds[split]
            return ds.to_iterable_dataset() if streaming else ds
        if os.path.isdir(path):
            return datasets.load_dataset(path, split=split, streaming=streaming)
        builder = BUILDERS.get(os.path.splitext(path)[1].lower())
        if builder is None:
            raise ConfigError(f"data.path={path!r}: a data file's suffix must be one of {sorted(BUILDERS)}. Fix: "
                              f"rename the file or point data.path at its folder.")
        return datasets.load_dataset(builder, data_files=path, split=split, streaming=streaming)
    except (KeyError, ValueError) as e:
        if "split" not in str(e).lower() and not isinstance(e, KeyError):
            raise ConfigError(f"data.path={path!r} could not be read as a dataset: {e}. Fix: check the files (a "
                              f"parquet / json / jsonl / csv / arrow / txt file, or a save_to_disk folder).") from None
        raise ConfigError(f"data.hf_split={split!r} is not a split of {path!r} ({e}). Fix: set data.hf_split to "
                          f"one of its splits (a single data file has only 'train').") from None
    except StopIteration:                        # datasets' json/csv readers on an empty file
        raise ConfigError(f"data.path={path!r} holds no record. Fix: point data.path at a dataset with records.") \
            from None


class RecordSource:
    """The endless record sequence of a dataset (module docstring)."""

    def __init__(self, path: str, split: str, streaming: bool):
        self.path, self.split, self.streaming = path, split, streaming
        self.dataset = open_dataset(path, split, streaming)
        self.size: Optional[int] = None if streaming else len(self.dataset)
        if self.size == 0 or (streaming and next(iter(self.dataset), None) is None):
            raise ConfigError(f"data.hf_split={split!r} of {path!r} holds no record. Fix: point data.path / "
                              f"data.hf_split at a split with records.")

    def first(self) -> dict:
        return next(self.records(0, 1))[1]

    def records(self, start: int, step: int = 1) -> Iterator[tuple]:
        """(i, record) for i = start, start + step, … of the endless sequence."""
        if not self.streaming:
            for i in range(start, 1 << 62, step):
                yield i, self.dataset[i % self.size]
            return
        i = 0
        while True:                                   # one pass per epoch
            for record in self.dataset:
                if i >= start and (i - start) % step == 0:
                    yield i, record
                i += 1
            self.size = i if self.size is None else self.size


def record_tokens(record: dict, kind: str, field: str, tokenizer, eod: Optional[int]) -> tuple:
    """(ids int64, trained bool) of one record (module docstring); the trained flag of token t says
    whether token t may be a target."""
    if kind == "chat":
        from .chat import render

        return render(record.get("messages"), tokenizer, eod)
    text = record.get(field)
    if not isinstance(text, str):
        raise ConfigError(f"a record of data.kind=hf has {'no' if text is None else 'a non-text'} field "
                          f"data.hf_text_field={field!r} (its fields: {sorted(record)}). Fix: set data.hf_text_field "
                          f"to the field that holds the text.")
    ids = tokenizer.encode(text) + ([] if eod is None else [eod])
    return np.asarray(ids, np.int64), np.ones(len(ids), bool)


def run_tokenizer_of(data):
    """The tokenizer ``data.kind`` hf/chat encodes with: ``data.tokenizer``'s file, a tokenizer folder with
    a chat template (:class:`gridshard.data.chat.TemplateTokenizer`), else bytes."""
    from .tokenizer import ByteTokenizer, HFTokenizer

    if not data.tokenizer:
        return ByteTokenizer()
    if os.path.isdir(data.tokenizer):
        from .chat import TemplateTokenizer

        return TemplateTokenizer(data.tokenizer)
    return HFTokenizer.from_file(data.tokenizer)


def check_records(data) -> None:
    """Before launch: the dataset opens, its split has records, and its first record has the text
    field (hf) or well-formed messages (chat) — one ConfigError otherwise."""
    source = RecordSource(data.path, data.hf_split, data.hf_streaming)
    record_tokens(source.first(), data.kind, data.hf_text_field, run_tokenizer_of(data), data.eod_token)
