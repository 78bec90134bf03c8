"""Chat records as training documents: a built-in template, the loss on the assistant's tokens only.

A record's ``messages`` is a list of ``{"role": "system" | "user" | "assistant", "content": str}``.
The built-in template renders each message as

    <|role|>\\n{content}<|end|>\\n

(``<|system|>``, ``<|user|>``, ``<|assistant|>``; the markers are plain text, encoded by the run's
tokenizer like the content), and the document ends with the end-of-document id when there is one.
Each piece is encoded on its own and the ids concatenated, so which token came from which piece
is exact. **Trained** (a target the loss counts) are the tokens of each assistant message's
``{content}<|end|>\\n``: the answer and its end marker, so the model learns to stop; the role
markers, system and user messages are context only. Through ``data.packing`` and
``data.document_mask`` the records are packed like any document.

(The flags say whether token t may be a *target*; the windows turn them into the targets' mask:
:mod:`gridshard.data.record_rows`.)
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ConfigError

ROLES = ("system", "user", "assistant")
END = "<|end|>\n"


def render(messages, tokenizer, eod: Optional[int] = None) -> tuple:
    """(ids int64, trained bool) of one record's ``messages`` (module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"a data.kind=chat record needs a non-empty list 'messages', not {messages!r:.80}. Fix: "
                          f"give each record messages=[{{'role': 'user', 'content': ...}}, ...].")
    ids, trained = [], []
    for m in messages:
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role not in ROLES or not isinstance(content, str):
            raise ConfigError(f"a chat message must be {{'role': one of {ROLES}, 'content': text}}, not {m!r:.80}. "
                              f"Fix: correct the record.")
        for text, learn in ((f"<|{role}|>\n", False), (content + END, role == "assistant")):
            piece = tokenizer.encode(text)
            ids += piece
            trained += [learn] * len(piece)
    if eod is not None:
        ids.append(eod)
        trained.append(False)
    return np.asarray(ids, np.int64), np.asarray(trained, bool)
