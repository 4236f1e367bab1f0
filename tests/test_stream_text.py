"""`Detokenizer` (`testbed/api/text.py`): streamed pieces join to the whole output's text, a
character split across tokens waits for its last byte, and each piece decodes a window of the
ids, not all of them (the server's event loop decodes one piece per stream and step)."""

from __future__ import annotations

import pytest

from testbed.api.text import Detokenizer


class Bytes:
    """A byte-level tokenizer: id = one UTF-8 byte, 0 a special token; counts what it
    decodes."""

    def __init__(self) -> None:
        self.decoded = []

    def decode(self, ids, skip_special_tokens=True):
        self.decoded.append(len(ids))
        return bytes(i for i in ids if i != 0).decode("utf-8", errors="replace")


TEXT = "naïve café: 東京 🙂 done"


def test_pieces_join_to_the_text_and_split_characters_wait_for_their_last_byte():
    tok = Bytes()
    detok = Detokenizer(tok)
    ids = [0, *TEXT.encode()]
    pieces = [detok.feed([i]) for i in ids]
    assert "".join(pieces) + detok.finish() == TEXT
    emoji = ids.index(0xF0)  # 🙂: four bytes, the first three give nothing
    assert pieces[emoji:emoji + 4] == ["", "", "", "🙂"]
    assert pieces[ids.index(0xC3) + 1] == "ï"


def test_each_piece_decodes_only_the_last_piece_and_the_new_ids():
    tok = Bytes()
    detok = Detokenizer(tok)
    for i in ("x" * 500).encode():
        detok.feed([i])
    assert max(tok.decoded) == 2  # the last piece's id and the new one, at any length


def test_finish_sends_a_partial_character_and_nothing_new_sends_nothing():
    detok = Detokenizer(Bytes())
    assert detok.feed(list("ab".encode())) == "ab"
    assert detok.feed([]) == ""
    assert detok.feed(list("é".encode())[:1]) == ""
    assert detok.finish() == "\ufffd"
    assert Detokenizer(None).feed([1, 2]) == ""


def test_the_real_tokenizer_streams_the_text_it_decodes_whole():
    from testbed.data import is_here, lookup, resolve_model

    pytest.importorskip("transformers")
    if not is_here(lookup("smollm2_135m_instruct")):
        pytest.skip("smollm2_135m_instruct is not in the data folder (make real)")
    from testbed.api.server import load_tokenizer

    tok = load_tokenizer(resolve_model("data:smollm2_135m_instruct"))
    ids = tok.encode(" Hello  world,\n naïve café: 東京 🙂🙂 done.") + [tok.eos_token_id]
    for step in (1, 2, 3):
        detok = Detokenizer(tok)
        pieces = [detok.feed(ids[i:i + step]) for i in range(0, len(ids), step)]
        assert "".join(pieces) + detok.finish() == tok.decode(ids, skip_special_tokens=True)
