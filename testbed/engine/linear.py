"""The model's linear layers with their weights prepared once for the CPU's fastest matmul.

A CPU decode step of a small model is mostly its matmuls, a few rows against every weight.
torch's ``linear`` in fp32 on one thread re-reads each weight in its stored layout per call and
does not amortize those reads over the rows: at 4-32 rows it costs 2-3x what oneDNN's matmul
costs on the same weights reordered once into its blocked layout (vLLM's CPU linear layers do
the same: a oneDNN matmul on weights prepared per layer at load). MKL's packed sgemm
(``torch.ops.mkl._mkl_linear``) measured no faster than plain ``linear`` here
(experiments/benchmarks/cpu_engine.py, docs/results/cpu_engine.md).

`prepare_linears` swaps every ``nn.Linear`` of a `LlamaModel` (the fused QKV and gate-up
projections included: `model.py` fuses them for every device) and its LM head for a
`PackedLinear` whose weight oneDNN reordered once, where ``linear="onednn"`` and a smoke test
passes on the model's device and dtype; on CUDA, or where the smoke test fails (a torch without
mkldnn, fp16 on a CPU without its instructions), the layers stay torch's, and the reason is
returned (the engine's ``linear_error``: a slower engine, never a wrong one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from testbed.engine.model import LlamaModel

#: the engine's matmul implementations (``engine.cpu_kernels`` picks one on the CPU)
LINEAR_KINDS = ("torch", "onednn")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered once into oneDNN's layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class PackedLinear(nn.Module):
    """``x @ weight.T + bias`` by oneDNN on a weight reordered once. The original weight stays
    (the tied embedding reads it; ``state_dict`` keeps its names), and is not read here.

    The packed copy follows the weight: moved or cast (``.to``, ``.half()``), deep-copied or
    unpickled, the layer packs its weight again, or, where oneDNN cannot take it (off the CPU,
    fp64), runs torch's ``linear`` on it: a stale copy would compute with the old weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.packed = pack(weight)

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def repack(self) -> None:
        try:
            self.packed = pack(self.weight) if self.weight.device.type == "cpu" else None
        except RuntimeError:  # a dtype oneDNN does not take: torch's linear
            self.packed = None

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        super()._apply(fn, recurse)
        self.repack()
        return self

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["packed"] = None  # an opaque tensor has no storage to copy: packed again
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.repack()


def smoke_test(device: torch.device, dtype: torch.dtype) -> None:
    """One small packed matmul (5 rows, with a bias) against torch's, within the dtype's
    rounding: raises where oneDNN cannot run it here."""
    if device.type != "cpu":
        raise RuntimeError(f"oneDNN packed weights are for the CPU, not {device.type}")
    g = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(*s, generator=g).to(dtype) for s in ((24, 32), (24,), (5, 32)))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(PackedLinear(w, b)(x), F.linear(x, w, b), atol=tol, rtol=tol)


def prepare_linears(model: LlamaModel, kind: str) -> tuple[str, str | None]:
    """The model's linear layers as ``kind`` (`LINEAR_KINDS`), prepared in place once (again:
    nothing changes). Returns the kind that runs and, where it is not ``kind``, why."""
    if kind not in LINEAR_KINDS:
        raise ValueError(f"linear kind must be one of {', '.join(LINEAR_KINDS)}, got {kind!r}")
    if kind == "torch":
        return "torch", None
    try:
        with torch.inference_mode():
            smoke_test(model.device, model.dtype)
    except Exception as e:  # noqa: BLE001 - any failure means: torch's linear here
        return "torch", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            linear = getattr(parent, name)
            if isinstance(linear, nn.Linear):
                setattr(parent, name, PackedLinear.of(linear))
    if model.head is None:
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.head = PackedLinear(weight, None)
    return kind, None
