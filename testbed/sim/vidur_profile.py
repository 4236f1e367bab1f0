"""Reading a Vidur operator profile: the measured times `VidurCostModel` predicts steps from.

Vidur (Agrawal et al., MLSys 2024) profiles a model's operators on a GPU and writes CSVs, times in
milliseconds, one row per profiled shape with ``time_stats.<op>.{min,max,mean,median,std}``:

- ``mlp.csv`` — token-level operators by ``num_tokens`` (`TOKEN_OPS`), with the model's shape in
  ``n_head, n_kv_head, n_embd, n_expanded_embd, use_gated_mlp, num_tensor_parallel_workers``;
- ``attention.csv`` — ``attn_prefill`` (one request: ``prefill_chunk_size`` new tokens over
  ``kv_cache_size`` cached ones) and ``attn_decode`` (``batch_size`` requests of
  ``kv_cache_size`` each), told apart by ``is_prefill``, shape in ``n_embd, n_q_head, n_kv_head,
  num_tensor_parallel_workers``; every other ``attn_*`` operator the file profiles (Vidur's
  reshapes) is added to its row's time;
- ``all_reduce.csv`` — collectives by message ``size`` in bytes and ``num_workers``
  (``collective`` and ``devices_per_node`` where present); read only when tp > 1.
  ``send_recv.csv`` (pipeline stages) is not read: specs have no pipeline parallelism.

`load_vidur_profile` keeps the rows of the model and TP degree asked for, and takes for each shape
the median column, the median over duplicate rows (Vidur's own predictor trains on the medians).
It refuses, in one line, a directory that does not hold that shape, and names the file and column
of anything missing or malformed. The profile is data the user supplies (``python -m testbed.data
fetch vidur_a100_codellama34b_tp2`` brings one: A100, CodeLlama-34B, TP2); nothing here needs it
to exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from testbed.errors import BadInput
from testbed.config.model_shape import ModelShape

#: Operators of one decoder layer in ``mlp.csv`` and how many times a layer runs each (``add``:
#: the two residual additions). ``emb`` runs once per step, outside the layers.
TOKEN_OPS: dict[str, int] = {
    "input_layernorm": 1, "attn_pre_proj": 1, "attn_rope": 1, "attn_post_proj": 1,
    "post_attention_layernorm": 1, "mlp_up_proj": 1, "mlp_act": 1, "mlp_down_proj": 1, "add": 2,
}
EMB_OP = "emb"
MLP_SHAPE = ("n_embd", "n_head", "n_kv_head", "n_expanded_embd", "use_gated_mlp",
             "num_tensor_parallel_workers")
ATTN_SHAPE = ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers")
MS = 1e-3  # Vidur's times are in milliseconds


class ProfileError(BadInput):
    """A profile directory that cannot serve the model asked for, or a malformed file."""


@dataclass(frozen=True)
class Grid:
    """Seconds measured on a grid: ``values[i, j]`` at ``rows[i]``, ``cols[j]``; NaN where the
    profile has no such shape (Vidur profiles prefill only where chunk + KV ≤ its max length)."""

    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class VidurProfile:
    """One model's measured operator times on one GPU type, in seconds (medians).

    ``ops[op][k]`` is operator ``op`` at ``tokens[k]`` tokens; ``prefill`` is indexed by (chunk,
    KV cached before it), ``decode`` by (batch size, KV per request); ``allreduce_s[k]`` is one
    all-reduce of ``allreduce_bytes[k]`` bytes among the model's ``tp`` ranks (empty when tp = 1).
    """

    directory: Path
    tokens: np.ndarray
    ops: dict[str, np.ndarray]
    prefill: Grid
    decode: Grid
    allreduce_bytes: np.ndarray
    allreduce_s: np.ndarray

    def layer_s(self) -> np.ndarray:
        """One layer's token-level operators at each profiled token count (``TOKEN_OPS``)."""
        return sum(count * self.ops[op] for op, count in TOKEN_OPS.items())


def load_vidur_profile(directory: str | Path, model: ModelShape) -> VidurProfile:
    """The profile in ``directory`` for ``model`` (its shape and ``tp``); `ProfileError` if the
    directory lacks it."""
    d = Path(directory)
    if not d.is_dir():
        raise ProfileError(f"cost_model.profile_dir: no such directory: {d}")
    mlp = _read(d / "mlp.csv", MLP_SHAPE + ("num_tokens",)
                + tuple(_col(op) for op in (EMB_OP, *TOKEN_OPS)))
    mlp = _rows_of(mlp, d, "mlp.csv", MLP_SHAPE, _mlp_needs(model), model)
    tokens, ops = _by_tokens(mlp)
    att = _read(d / "attention.csv", ATTN_SHAPE + (
        "is_prefill", "batch_size", "prefill_chunk_size", "kv_cache_size",
        _col("attn_prefill"), _col("attn_decode")))
    att = _rows_of(att, d, "attention.csv", ATTN_SHAPE, _attn_needs(model), model)
    prefill, decode = _attention_grids(att)
    sizes, seconds = np.zeros(0), np.zeros(0)
    if model.tp > 1:
        sizes, seconds = _allreduce(d / "all_reduce.csv", model.tp)
    return VidurProfile(d, tokens, ops, prefill, decode, sizes, seconds)


def _col(op: str) -> str:
    return f"time_stats.{op}.median"


def _read(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    """The CSV at ``path`` with its ``required`` columns checked present and numeric (or
    boolean)."""
    if not path.is_file():
        raise ProfileError(f"cost_model.profile_dir: missing {path.name} in {path.parent} "
                           f"(Vidur's profile: mlp.csv, attention.csv, all_reduce.csv)")
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: not a readable CSV ({e})") from None
    for column in required:
        if column not in df.columns:
            raise ProfileError(f"{path}: missing column {column}")
        values = df[column]
        if column in ("is_prefill", "use_gated_mlp"):
            df[column] = _booleans(values, path, column)
        elif not pd.api.types.is_numeric_dtype(values):
            bad = values[pd.to_numeric(values, errors="coerce").isna() & values.notna()]
            raise ProfileError(f"{path}: column {column} must be numeric, got {bad.iloc[0]!r} "
                               f"in row {bad.index[0] + 2}")
    return df


def _booleans(values: pd.Series, path: Path, column: str) -> pd.Series:
    mapping = {True: True, False: False, "True": True, "False": False, "true": True,
               "false": False, 1: True, 0: False}
    out = values.map(lambda v: mapping.get(v))
    if out.isna().any():
        row = int(np.flatnonzero(out.isna().to_numpy())[0])
        raise ProfileError(f"{path}: column {column} must be True or False, got "
                           f"{values.iloc[row]!r} in row {row + 2}")
    return out.astype(bool)


def _mlp_needs(m: ModelShape) -> tuple[Any, ...]:
    return (m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size, True, m.tp)


def _attn_needs(m: ModelShape) -> tuple[Any, ...]:
    return (m.hidden_size, m.num_heads, m.num_kv_heads, m.tp)


_SHORT = {"num_tensor_parallel_workers": "tp", "use_gated_mlp": "gated_mlp"}


def _describe(names: tuple[str, ...], values: tuple[Any, ...]) -> str:
    return " ".join(f"{_SHORT.get(k, k)}={v}" for k, v in zip(names, values))


def _rows_of(df: pd.DataFrame, d: Path, name: str, shape: tuple[str, ...],
             needs: tuple[Any, ...], model: ModelShape) -> pd.DataFrame:
    """The rows of ``df`` profiled for ``needs`` (values of the ``shape`` columns)."""
    keep = np.ones(len(df), dtype=bool)
    for column, value in zip(shape, needs):
        keep &= (df[column] == value).to_numpy()
    if keep.any():
        return df[keep]
    held = sorted({tuple(row) for row in df[list(shape)].itertuples(index=False)}, key=str)
    holds = " | ".join(_describe(shape, tuple(h)) for h in held) or "no rows"
    raise ProfileError(f"cost_model.profile_dir={d} holds {holds} ({name}); model={model.name} "
                       f"needs {_describe(shape, needs)}")


def _by_tokens(mlp: pd.DataFrame) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    columns = [_col(op) for op in (EMB_OP, *TOKEN_OPS)]
    _no_gaps(mlp, "mlp.csv", columns)
    g = mlp.groupby("num_tokens")[columns].median()
    tokens = g.index.to_numpy(dtype=np.int64)
    if tokens.min() < 1:
        raise ProfileError(f"mlp.csv: column num_tokens must be >= 1, got {tokens.min()}")
    return tokens, {op: g[_col(op)].to_numpy(dtype=float) * MS for op in (EMB_OP, *TOKEN_OPS)}


def _no_gaps(df: pd.DataFrame, name: str, columns: list[str]) -> None:
    for column in columns:
        missing = df[column].isna().to_numpy()
        if missing.any():
            raise ProfileError(f"{name}: column {column} is empty in row "
                               f"{df.index[np.flatnonzero(missing)[0]] + 2}")
        if (df[column] < 0).any():
            raise ProfileError(f"{name}: column {column} has a negative time")


def _attention_grids(att: pd.DataFrame) -> tuple[Grid, Grid]:
    extra = [c for c in att.columns if c.startswith("time_stats.attn_") and c.endswith(".median")
             and c not in (_col("attn_prefill"), _col("attn_decode"))]
    grids = []
    for prefill, op, row_key in ((True, "attn_prefill", "prefill_chunk_size"),
                                 (False, "attn_decode", "batch_size")):
        rows = att[att["is_prefill"] == prefill]
        if rows.empty:
            raise ProfileError(f"attention.csv: no rows with is_prefill={prefill} ({op})")
        _no_gaps(rows, "attention.csv", [_col(op)])
        seconds = (rows[_col(op)] + rows[extra].fillna(0.0).sum(axis=1)) * MS
        g = seconds.groupby([rows[row_key], rows["kv_cache_size"]]).median().unstack()
        if g.index.min() < 1 or g.columns.min() < 0:
            raise ProfileError(f"attention.csv: {row_key} must be >= 1 and kv_cache_size >= 0")
        grids.append(Grid(g.index.to_numpy(dtype=float), g.columns.to_numpy(dtype=float),
                          g.to_numpy(dtype=float)))
    return grids[0], grids[1]


def _allreduce(path: Path, tp: int) -> tuple[np.ndarray, np.ndarray]:
    df = _read(path, ("num_workers", "size", _col("all_reduce")))
    if "collective" in df.columns:
        df = df[df["collective"] == "all_reduce"]
    df = df[df[_col("all_reduce")].notna()]
    rows = df[df["num_workers"] == tp]
    if rows.empty:
        held = ", ".join(str(w) for w in sorted(df["num_workers"].unique()))
        raise ProfileError(f"{path}: all-reduces profiled for num_workers={held or 'none'}; "
                           f"model tp={tp} needs num_workers={tp}")
    if "devices_per_node" in rows.columns:  # the fewest nodes: NVLink, not the network
        rows = rows[rows["devices_per_node"] == rows["devices_per_node"].max()]
    if (rows[_col("all_reduce")] < 0).any() or (rows["size"] < 1).any():
        raise ProfileError(f"{path}: negative time or size < 1 byte in column "
                           f"{_col('all_reduce')} / size")
    g = rows.groupby("size")[_col("all_reduce")].median()
    return g.index.to_numpy(dtype=float), g.to_numpy(dtype=float) * MS
