"""Files the fuzzer's configs read, written once into its work folder, so that every workload
generator and ``model.path`` run without the data folder (no download, no real tokenizer):

- ``tokenizer/``: a character-level HF tokenizer (printable ASCII and newline, one token each,
  then ``<|im_start|>`` and ``<|im_end|>``, its EOS) with a ChatML chat template: 98 ids, inside
  ``model=tiny``'s vocabulary of 256, so text workloads (`sharegpt`, `sharegpt_chat`,
  `copy_text`, `few_shot_text`, `rag_text`, `paraphrase_text`) run on the tiny engine too;
- ``sharegpt.json``: a small ShareGPT file of made-up conversations (1–4 turns, some opening
  with a system message, some with a gpt one, which `sharegpt_chat` leaves out), its replies
  long enough for `copy_text`'s passages;
- ``checkpoint/``: a random ``model=tiny``-shaped Llama saved as an HF checkpoint
  (`testbed.engine.loader.save_random_hf_model`) with the tokenizer beside it, for
  ``model.path`` (the fuzzer's server serves it, so ``server.prompt_format=text`` runs).

The contents depend on nothing but this module, so a failing command line reproduces with the
same files (`Fixtures.write` into any folder).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
SPECIAL = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
WORDS = ("the cache keeps a prefix of every prompt it has seen and evicts the least recently "
         "used leaf when the pool is full so that a later request finds its system prompt "
         "already computed while a new question is prefilled from scratch").split()


@dataclass(frozen=True)
class Fixtures:
    root: Path

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def sharegpt(self) -> Path:
        return self.root / "sharegpt.json"

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    def write(self) -> None:
        """Write whatever of the three is missing."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.tokenizer / "tokenizer.json").is_file():
            write_tokenizer(self.tokenizer)
        if not self.sharegpt.is_file():
            self.sharegpt.write_text(json.dumps(conversations()))
        if not (self.checkpoint / "config.json").is_file():
            from transformers.utils import logging

            from testbed.engine.loader import save_random_hf_model

            logging.disable_progress_bar()  # its bar would interleave with the fuzzer's
            save_random_hf_model(self.checkpoint, seed=0)
        if not (self.checkpoint / "tokenizer.json").is_file():
            write_tokenizer(self.checkpoint)


def write_tokenizer(path: Path) -> None:
    """The character-level tokenizer (module docstring), saved as an HF tokenizer directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=SPECIAL[1],
                                  additional_special_tokens=[SPECIAL[0]])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))


def sentence(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=words)).capitalize() + "."


def conversations(count: int = 12) -> list[dict]:
    """``count`` made-up ShareGPT conversations (module docstring), the same every time."""
    rng = np.random.default_rng(58)
    out = []
    for i in range(count):
        turns = []
        if i % 4 == 1:
            turns.append({"from": "system", "value": "You answer briefly."})
        if i % 6 == 5:
            turns.append({"from": "gpt", "value": sentence(rng, 6)})
        for _ in range(int(rng.integers(1, 5))):
            turns.append({"from": "human", "value": sentence(rng, int(rng.integers(3, 12)))})
            reply = "\n".join(sentence(rng, int(rng.integers(3, 9)))
                              for _ in range(int(rng.integers(1, 4))))
            turns.append({"from": "gpt", "value": reply})
        out.append({"id": f"conv{i}", "conversations": turns})
    return out
