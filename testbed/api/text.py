"""`Detokenizer`: a stream of output token ids as text pieces, for streamed answers.

Each piece is the text the new ids add to the text already sent. A piece ending in U+FFFD (a
character whose bytes are split across tokens) is held back until the next token completes it;
`finish` sends whatever is left. Without a tokenizer every piece is empty (a token-id model:
clients read ``token_ids``).

Only a window of the ids is decoded per piece, not all of them: the ids of the last piece sent
and the new ones. Their text less the last piece's text is the new piece, the same as the whole
output's text less the text sent, since the window starts where a piece ended (a character
boundary) and a decoder that treats a sequence's start apart (SentencePiece drops a leading
space) does so alike in both. Decoding everything each time cost O(length) a token: at 512
tokens ~0.2 ms a stream and step, in the server's event loop, which shares the interpreter's
lock with the engine's thread.
"""

from __future__ import annotations

from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window's first id: where the last piece sent began
        self.done = 0  # ids whose text has been sent

    def _text(self, stop: int) -> str:
        if self.tokenizer is None or stop <= self.start:
            return ""
        return self.tokenizer.decode(self.ids[self.start:stop], skip_special_tokens=True)

    def feed(self, ids) -> str:
        """The text the new ``ids`` add (maybe held back, see the module docstring)."""
        self.ids.extend(ids)
        return self._piece(hold_partial=True)

    def finish(self) -> str:
        """The text not sent yet, a partial character included."""
        return self._piece(hold_partial=False)

    def _piece(self, hold_partial: bool) -> str:
        if self.done == len(self.ids):  # nothing new: the window keeps the last piece's ids
            return ""
        sent, window = self._text(self.done), self._text(len(self.ids))
        if (hold_partial and window.endswith("\ufffd")) or not window.startswith(sent):
            return ""
        self.start, self.done = self.done, len(self.ids)
        return window[len(sent):]
