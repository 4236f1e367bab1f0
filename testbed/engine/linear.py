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

A decode step's few rows (up to `PANEL_ROWS`, on one torch thread) go instead to a C kernel on
a second copy of the weight packed into panels of 32 output columns (``cpu_linear.c``, built
with the other native kernels, `testbed.engine.native_build`): at those rows the step is bound
by reading every weight once, which oneDNN does at ~32 GB/s here and the panels at ~38, and the
panel kernel's register tile keeps it ahead beyond (1.5x at 8 rows, 1.16x at 32, 1.07x at 64,
thirty layers' weights streamed from memory: `python -m experiments.benchmarks.cpu_engine`). Where the library cannot be built the
layers run oneDNN alone (the summary's ``decode_kernel_error`` says why: the same library).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from testbed.engine.native_build import load_library
from testbed.errors import check_choice

if TYPE_CHECKING:
    from testbed.engine.model import LlamaModel

#: the engine's matmul implementations (``engine.cpu_kernels`` picks one on the CPU)
LINEAR_KINDS = ("torch", "onednn")
#: rows up to which the panel kernel runs (a decode step's); above, oneDNN's matmul (a prefill)
PANEL_ROWS = 64
PANEL = 32  # output columns a panel


@lru_cache(maxsize=None)
def panel_kernel() -> Any:
    """The C function (``panel_linear``), or None where the native library cannot be had."""
    try:
        fn = load_library().panel_linear
    except Exception:  # noqa: BLE001 - no compiler, a failed build: oneDNN alone
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def panels(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` as panels ``[out / 32, in, 32]`` for the panel kernel, or None where
    it does not apply (not fp32 on the CPU, ``out`` not a multiple of 32, no kernel)."""
    out = weight.shape[0]
    if (weight.dtype != torch.float32 or weight.device.type != "cpu" or out % PANEL
            or panel_kernel() is None):
        return None
    return weight.detach().view(out // PANEL, PANEL, -1).transpose(1, 2).contiguous()


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
        self.panels = panels(weight)

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.panels is not None and x.dim() == 2 and x.shape[0] <= PANEL_ROWS
                and torch.get_num_threads() == 1):  # the panel kernel runs on one thread
            return self.panel_forward(x)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def panel_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"the panel kernel is fp32 only, got {x.dtype}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = torch.empty((x.shape[0], self.weight.shape[0]), dtype=torch.float32)
        bias = 0 if self.bias is None else self.bias.data_ptr()
        panel_kernel()(x.data_ptr(), x.stride(0), x.shape[0], self.panels.data_ptr(),
                       self.weight.shape[1], self.weight.shape[0], bias, y.data_ptr())
        return y

    def repack(self) -> None:
        try:
            self.packed = pack(self.weight) if self.weight.device.type == "cpu" else None
        except RuntimeError:  # a dtype oneDNN does not take: torch's linear
            self.packed = None
        self.panels = panels(self.weight)

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
    w, b, x = (torch.randn(*s, generator=g).to(dtype) for s in ((64, 32), (64,), (40, 32)))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    layer = PackedLinear(w, b)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=tol, rtol=tol)  # oneDNN
    if layer.panels is not None:  # 5 rows: the panel kernel
        torch.testing.assert_close(layer.panel_forward(x[:5]), F.linear(x[:5], w, b), atol=tol,
                                   rtol=tol)


def prepare_linears(model: LlamaModel, kind: str) -> tuple[str, str | None]:
    """The model's linear layers as ``kind`` (`LINEAR_KINDS`), prepared in place once (again:
    nothing changes). Returns the kind that runs and, where it is not ``kind``, why."""
    check_choice("linear kind", kind, LINEAR_KINDS, error=ValueError)
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
