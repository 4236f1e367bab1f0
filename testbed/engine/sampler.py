"""Next-token sampling, vectorised over the batch: greedy, temperature, top-p; seeded.

``temperature`` 0 is greedy (argmax, the first index on ties). Otherwise logits are divided by the
temperature and, with ``top_p < 1``, sampling is restricted to the smallest set of most likely
tokens whose probability reaches ``top_p`` (the most likely token always stays), as HF does.
Randomness comes only from the `torch.Generator` passed in, so the same seed gives the same tokens.
"""

from __future__ import annotations

import torch

from testbed.errors import BadInput


def _per_row(value: float | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    return t.expand(rows) if t.dim() == 0 else t


def sample(logits: torch.Tensor, temperature: float | torch.Tensor = 0.0,
           top_p: float | torch.Tensor = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids ``[B]`` (int64) from ``logits [B, vocab]``; ``temperature`` and ``top_p`` are
    scalars or ``[B]`` tensors."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if isinstance(temperature, (int, float)) and temperature == 0:
        return greedy
    rows = logits.shape[0]
    temp = _per_row(temperature, rows, logits.device)
    probs = torch.softmax(logits / temp.clamp_min(1e-6)[:, None], dim=-1)
    if isinstance(top_p, (int, float)) and top_p >= 1.0:
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    else:
        p = _per_row(top_p, rows, logits.device)
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        keep = before < p[:, None]
        keep[:, 0] = True
        choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        sampled = order.gather(1, choice).squeeze(1)
    return torch.where(temp == 0, greedy, sampled)


class Sampler:
    """`sample` with fixed settings and its own generator (``seed``) on ``device``."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        if temperature < 0:
            raise BadInput(f"temperature must be >= 0, got {temperature}")
        if not 0 <= top_p <= 1:
            raise BadInput(f"top_p must be in [0, 1], got {top_p}")
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return sample(logits, self.temperature, self.top_p, self.generator)
