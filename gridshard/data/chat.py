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

**The tokenizer's own template.** When ``data.tokenizer`` is a Hugging Face tokenizer *folder*
(``tokenizer.json`` with a ``tokenizer_config.json`` holding ``chat_template``, as saved by
``transformers``; ``pip install -e .[hf]``), that template renders the conversation instead
(:class:`TemplateTokenizer`). The assistant's part is found without markers in the template: for
each assistant message i, the rendering of messages < i with the generation prompt, then of
messages ≤ i; the text between the two is the answer as the template writes it (trained), the rest
context. Each piece is encoded on its own (special tokens in the text, such as ``<|im_end|>``, are
the tokenizer's added tokens). A template whose rendering of a conversation is not a prefix of its
continuation's cannot be cut this way and is refused with a message.

(The flags say whether token t may be a *target*; the windows turn them into the targets' mask:
:mod:`gridshard.data.record_rows`.)
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ConfigError

ROLES = ("system", "user", "assistant")
END = "<|end|>\n"


def _checked(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"a data.kind=chat record needs a non-empty list 'messages', not {messages!r:.80}. Fix: "
                          f"give each record messages=[{{'role': 'user', 'content': ...}}, ...].")
    for m in messages:
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role not in ROLES or not isinstance(content, str):
            raise ConfigError(f"a chat message must be {{'role': one of {ROLES}, 'content': text}}, not {m!r:.80}. "
                              f"Fix: correct the record.")
    return messages


def _built_in(messages) -> list:
    """(text, trained) pieces of the built-in template (module docstring)."""
    return [piece for m in messages
            for piece in ((f"<|{m['role']}|>\n", False), (m["content"] + END, m["role"] == "assistant"))]


def _templated(messages, render_text) -> list:
    """(text, trained) pieces of a tokenizer's template ``render_text(messages, add_generation_prompt)``
    (module docstring, "The tokenizer's own template")."""
    pieces, done = [], ""

    def upto(text: str, learn: bool):
        nonlocal done
        if not text.startswith(done):
            raise ConfigError("the tokenizer's chat template renders a conversation so that it is not a prefix of "
                              "its continuation, so the assistant's part cannot be cut out of it. Fix: use a "
                              "tokenizer.json file (the built-in template) for data.tokenizer.")
        pieces.append((text[len(done):], learn))
        done = text

    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            upto(render_text(messages[:i], True), False)
        upto(render_text(messages[:i + 1], False), m["role"] == "assistant")
    return pieces


class TemplateTokenizer:
    """A Hugging Face tokenizer folder with a chat template (module docstring): ``encode``,
    ``vocab_size``, ``eos_id`` as :class:`gridshard.data.tokenizer.HFTokenizer`, and ``chat_text``."""

    kind = "hf"

    def __init__(self, folder: str):
        from ..errors import need_package

        transformers = need_package("transformers", "a tokenizer folder's chat template is rendered by Hugging Face "
                                    "`transformers`, which is not installed. Fix: pip install -e .[hf], or point "
                                    "data.tokenizer at a tokenizer.json file (the built-in template).")
        self.tok = transformers.AutoTokenizer.from_pretrained(folder)
        if not getattr(self.tok, "chat_template", None):
            raise ConfigError(f"data.tokenizer={folder!r} holds no chat_template. Fix: add one to its "
                              f"tokenizer_config.json, or point data.tokenizer at its tokenizer.json (the built-in "
                              f"template).")
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id

    def encode(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=False)

    def chat_text(self, messages, add_generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render(messages, tokenizer, eod: Optional[int] = None) -> tuple:
    """(ids int64, trained bool) of one record's ``messages`` (module docstring): the tokenizer's
    template when it has one (:class:`TemplateTokenizer`), else the built-in one."""
    messages = _checked(messages)
    chat_text = getattr(tokenizer, "chat_text", None)
    pieces = _templated(messages, chat_text) if chat_text is not None else _built_in(messages)
    ids, trained = [], []
    for text, learn in pieces:
        piece = tokenizer.encode(text)
        ids += piece
        trained += [learn] * len(piece)
    if eod is not None:
        ids.append(eod)
        trained.append(False)
    return np.asarray(ids, np.int64), np.asarray(trained, bool)
