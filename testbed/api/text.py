"""`Detokenizer`: a stream of output token ids as text pieces, for streamed answers.

Each piece is the text of all ids so far less the text already sent. A piece ending in U+FFFD
(a character whose bytes are split across tokens) is held back until the next token completes
it; `finish` sends whatever is left. Without a tokenizer every piece is empty (a token-id model:
clients read ``token_ids``).
"""

from __future__ import annotations

from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def text(self) -> str:
        if self.tokenizer is None or not self.ids:
            return ""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def feed(self, ids) -> str:
        """The text the new ``ids`` add (maybe held back, see the module docstring)."""
        self.ids.extend(ids)
        full = self.text()
        if full.endswith("\ufffd") or not full.startswith(self.sent):
            return ""
        piece, self.sent = full[len(self.sent):], full
        return piece

    def finish(self) -> str:
        full = self.text()
        piece = full[len(self.sent):] if full.startswith(self.sent) else ""
        self.sent = full
        return piece
