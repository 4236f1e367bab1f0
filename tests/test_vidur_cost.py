"""The Vidur-profile cost model: reading Vidur's CSVs, exact at profiled points, Vidur 0.0.26's
rules (token counts rounded up to 8, KV rounded up to its granularity, the decode batching overhead,
NCCL launches), monotone, a cached prefix priced by its attention only, refusals that say what the
directory holds, and a whole run.

The core tests write small profiles in Vidur's own column layout (the headers of
Vidur's A100 CodeLlama-34B profile) with linear times; the tests on the real profile read it from
the data folder (``python -m testbed.data fetch vidur_a100_codellama34b_tp2``; `make test` fetches
it), else ../shared's copy, else skip saying how to fetch it."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.sim.cost_model import COST_MODELS, RooflineCostModel, StepShape
from testbed.config.model_shape import ModelShape
from testbed.sim.specs import hardware_spec, model_spec
from testbed.sim.vidur_cost import VidurCostModel, round_up
from testbed.sim.vidur_profile import TOKEN_OPS, ProfileError, load_vidur_profile
from tests.conftest import vidur_profile

REPO = Path(__file__).resolve().parents[1]
MODEL = ModelShape("t", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=128, vocab_size=256, tp=2)
STATS = ("min", "max", "mean", "median", "std")
MLP_OPS = ("emb", *TOKEN_OPS)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
CHUNKS, PREFILL_KV = (16, 32, 64, 128), (0, 32, 64, 96)  # profiled where chunk + KV <= 128
BATCHES, DECODE_KV = (1, 2, 4, 8), (32, 64, 96, 128)


# Synthetic times in ms, linear so that every rule (interpolation, slopes) can be checked by hand.
def op_ms(op: str, tokens: int) -> float:
    i = MLP_OPS.index(op)
    return 0.002 * (i + 1) + 1e-4 * (i + 1) * tokens


def prefill_ms(chunk: int, kv: int) -> float:
    return 0.01 + 2e-6 * (chunk * kv + chunk * chunk / 2)


def decode_ms(batch: int, kv: int) -> float:
    return 0.005 + 1e-6 * batch * kv


RESHAPE_MS = 0.001  # attn_output_reshape on every attention row


def allreduce_ms(size: int) -> float:
    return 0.008 + 5e-9 * size


def stats(prefix: str, median: float) -> dict:
    """Vidur's five columns for one operator; only the median is used."""
    values = (0.9 * median, 1.3 * median, 1.1 * median, median, 0.01)
    return {f"time_stats.{prefix}.{s}": v for s, v in zip(STATS, values)}


def write_profile(d: Path, m: ModelShape = MODEL) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for t in TOKENS:
        row = {}
        for op in MLP_OPS:
            row |= stats(op, op_ms(op, t))
        rows.append(row | {"n_head": m.num_heads, "n_kv_head": m.num_kv_heads,
                           "n_embd": m.hidden_size, "n_expanded_embd": m.intermediate_size,
                           "vocab_size": 32768, "use_gated_mlp": True, "num_tokens": t,
                           "num_tensor_parallel_workers": m.tp})
    pd.DataFrame(rows).to_csv(d / "mlp.csv", index=False)
    shape = {"n_embd": m.hidden_size, "n_q_head": m.num_heads, "n_kv_head": m.num_kv_heads,
             "block_size": 16, "num_tensor_parallel_workers": m.tp, "max_model_len": 128}
    nan = float("nan")
    rows = []
    for b in BATCHES:
        for k in DECODE_KV:
            rows.append(stats("attn_input_reshape", 0.0) | stats("attn_decode", decode_ms(b, k))
                        | stats("attn_output_reshape", RESHAPE_MS) | stats("attn_prefill", nan)
                        | shape | {"batch_size": b, "prefill_chunk_size": 0, "kv_cache_size": k,
                                   "is_prefill": False})
    for n in CHUNKS:
        for k in PREFILL_KV:
            if n + k <= 128:
                rows.append(stats("attn_input_reshape", 0.0) | stats("attn_decode", nan)
                            | stats("attn_output_reshape", RESHAPE_MS)
                            | stats("attn_prefill", prefill_ms(n, k)) | shape
                            | {"batch_size": 1, "prefill_chunk_size": n, "kv_cache_size": k,
                               "is_prefill": True})
    pd.DataFrame(rows).assign(attention_backend="AttentionBackend.FLASH_ATTENTION",
                              profile_method="ProfileMethod.KINETO").to_csv(
        d / "attention.csv", index=False)
    rows = []
    for t in TOKENS:
        size = t * m.hidden_size * m.dtype_bytes
        for collective in ("all_reduce", "all_gather"):
            ar = allreduce_ms(size) if collective == "all_reduce" else nan
            ag = nan if collective == "all_reduce" else 2 * allreduce_ms(size)
            rows.append(stats("all_reduce", ar) | stats("all_gather", ag)
                        | {"rank": 0, "num_workers": m.tp, "size": size, "collective": collective,
                           "devices_per_node": m.tp, "max_devices_per_node": 4})
    pd.DataFrame(rows).to_csv(d / "all_reduce.csv")  # Vidur's files keep pandas' index column
    return d


@pytest.fixture
def profile_dir(tmp_path) -> Path:
    return write_profile(tmp_path / "profile")


#: Vidur's rules off but the rounding of token counts (not a setting): the profile as measured.
PLAIN = {"kv_granularity": 1, "decode_batching_overhead": 0.0, "nccl_launch_s": 0.0}


def vidur(d: Path, model: ModelShape = MODEL, overhead_s: float = 0.0, **rules) -> VidurCostModel:
    return VidurCostModel(load_vidur_profile(d, model), model, overhead_s, **(PLAIN | rules))


def layer_ms(tokens: int) -> float:
    return sum(count * op_ms(op, tokens) for op, count in TOKEN_OPS.items())


def r8(tokens: int) -> int:
    """Vidur's ``Batch._total_num_q_tokens_rounded``."""
    return round_up(tokens, 8)


# ---- reading the profile ----

def test_profile_holds_the_medians_in_seconds(profile_dir):
    p = load_vidur_profile(profile_dir, MODEL)
    assert p.tokens.tolist() == list(TOKENS)
    assert p.ops["mlp_up_proj"].tolist() == pytest.approx([op_ms("mlp_up_proj", t) / 1e3
                                                           for t in TOKENS], rel=1e-12)
    assert p.prefill.rows.tolist() == list(CHUNKS) and p.prefill.cols.tolist() == list(PREFILL_KV)
    assert p.prefill.values[0, 1] == pytest.approx((prefill_ms(16, 32) + RESHAPE_MS) / 1e3)
    assert np.isnan(p.prefill.values[3, 1])  # 128 + 32 > 128: not profiled
    assert p.decode.values[2, 3] == pytest.approx((decode_ms(4, 128) + RESHAPE_MS) / 1e3)
    assert p.allreduce_bytes.tolist() == [t * 128 for t in TOKENS]  # all_gather rows left out
    assert p.allreduce_s[0] == pytest.approx(allreduce_ms(128) / 1e3)


def test_duplicate_rows_take_their_median(profile_dir):
    mlp = pd.read_csv(profile_dir / "mlp.csv")
    extra = mlp[mlp.num_tokens == 8].copy()
    extra["time_stats.add.median"] += 0.004
    pd.concat([mlp, extra]).to_csv(profile_dir / "mlp.csv", index=False)
    p = load_vidur_profile(profile_dir, MODEL)
    assert p.ops["add"][TOKENS.index(8)] == pytest.approx((op_ms("add", 8) + 0.002) / 1e3)


def edit_csv(path: Path, edit) -> None:
    df = pd.read_csv(path)
    df = edit(df)
    df.to_csv(path, index=False)


@pytest.mark.parametrize("file, edit, message", [
    ("mlp.csv", lambda df: df.drop(columns="time_stats.mlp_up_proj.median"),
     r"mlp.csv: missing column time_stats.mlp_up_proj.median$"),
    ("attention.csv", lambda df: df.drop(columns="kv_cache_size"),
     r"attention.csv: missing column kv_cache_size$"),
    ("all_reduce.csv", lambda df: df.drop(columns="size"), r"all_reduce.csv: missing column size$"),
    ("mlp.csv", lambda df: df.astype({"time_stats.attn_rope.median": object}).assign(
        **{"time_stats.attn_rope.median": ["fast"] + [0.1] * (len(df) - 1)}),
     r"mlp.csv: column time_stats.attn_rope.median must be numeric, got 'fast' in row 2$"),
    ("attention.csv", lambda df: df.assign(is_prefill="maybe"),
     r"attention.csv: column is_prefill must be True or False, got 'maybe' in row 2$"),
    ("mlp.csv", lambda df: df.assign(**{"time_stats.emb.median": float("nan")}),
     r"mlp.csv: column time_stats.emb.median is empty in row 2$"),
    ("all_reduce.csv", lambda df: df.assign(num_workers=4),
     r"all_reduce.csv: all-reduces profiled for num_workers=4; model tp=2 needs num_workers=2$"),
])
def test_a_malformed_csv_names_the_file_and_column(profile_dir, file, edit, message):
    edit_csv(profile_dir / file, edit)
    with pytest.raises(ProfileError, match=message):
        load_vidur_profile(profile_dir, MODEL)


@pytest.mark.parametrize("name", ["mlp.csv", "attention.csv", "all_reduce.csv"])
def test_a_missing_csv_is_named(profile_dir, name):
    (profile_dir / name).unlink()
    with pytest.raises(ProfileError, match=f"cost_model.profile_dir: missing {name} in "):
        load_vidur_profile(profile_dir, MODEL)


def test_tp1_needs_no_all_reduce_profile(tmp_path):
    m = ModelShape("t1", 3, 64, 4, 2, 16, 128, 256, tp=1)
    d = write_profile(tmp_path / "p", m)
    (d / "all_reduce.csv").unlink()
    assert vidur(d, m).parts(StepShape.decode([64])).all_reduce == 0.0


def test_a_profile_of_another_model_is_refused_in_one_line(profile_dir):
    other = ModelShape("llama3_8b", 32, 4096, 32, 8, 128, 14336, 128256, tp=1)
    with pytest.raises(ProfileError) as e:
        load_vidur_profile(profile_dir, other)
    assert str(e.value) == (
        f"cost_model.profile_dir={profile_dir} holds n_embd=64 n_head=4 n_kv_head=2 "
        "n_expanded_embd=128 gated_mlp=True tp=2 (mlp.csv); model=llama3_8b needs n_embd=4096 "
        "n_head=32 n_kv_head=8 n_expanded_embd=14336 gated_mlp=True tp=1")
    with pytest.raises(ProfileError, match=r"holds .* tp=2 \(mlp.csv\); model=t needs .* tp=1$"):
        load_vidur_profile(profile_dir, ModelShape("t", 3, 64, 4, 2, 16, 128, 256, tp=1))


# ---- predictions ----

def test_exact_at_profiled_points(profile_dir):
    """Σ layers × (operators + attention + 2 all-reduces) + embedding + overhead, from the CSVs'
    medians, at shapes the profile measured (token counts rounded up to 8)."""
    v = vidur(profile_dir, overhead_s=0.003)
    L, ms = MODEL.num_layers, 1e-3
    for b, k in ((4, 64), (1, 32), (8, 128)):
        expected = (L * layer_ms(r8(b)) + op_ms("emb", r8(b)) + L * (decode_ms(b, k) + RESHAPE_MS)
                    + 2 * L * allreduce_ms(r8(b) * 128)) * ms + 0.003
        assert v.step_time(StepShape.decode([k] * b)) == pytest.approx(expected, rel=1e-12)
    for n, c in ((16, 0), (32, 64), (64, 64), (128, 0)):
        expected = (L * layer_ms(n) + op_ms("emb", n) + L * (prefill_ms(n, c) + RESHAPE_MS)
                    + 2 * L * allreduce_ms(n * 128)) * ms + 0.003
        assert v.step_time(StepShape((n,), (c,))) == pytest.approx(expected, rel=1e-12)


def test_parts_of_a_step(profile_dir):
    v = vidur(profile_dir, overhead_s=0.003)
    parts = v.parts(StepShape((32,), (64,)))
    assert parts.token_ops == pytest.approx((3 * layer_ms(32) + op_ms("emb", 32)) / 1e3)
    assert parts.attention == pytest.approx(3 * (prefill_ms(32, 64) + RESHAPE_MS) / 1e3)
    assert parts.all_reduce == pytest.approx(6 * allreduce_ms(32 * 128) / 1e3)
    assert parts.overhead == 0.003 and parts.total == v.step_time(StepShape((32,), (64,)))


def test_a_batch_of_chunks_pays_the_kernel_set_up_once(profile_dir):
    v = vidur(profile_dir)
    launch = (prefill_ms(16, 0) + RESHAPE_MS) / 1e3  # the smallest profiled prefill kernel
    one, two = (v.prefill_attention((n,), (c,)) for n, c in ((32, 64), (64, 0)))
    assert v.prefill_attention((32, 64), (64, 0)) == pytest.approx(one + two - launch)


def test_beyond_the_profile(profile_dir):
    """Linear profiles extrapolate exactly: attention per cached token at the row's own rate,
    token-level operators and all-reduces at their largest points' slope."""
    v = vidur(profile_dir)
    ms = 1e-3
    assert v.prefill_attention((16,), (5000,)) == pytest.approx(
        (prefill_ms(16, 5000) + RESHAPE_MS) * ms)
    assert v.decode_attention((5000, 7000)) == pytest.approx((decode_ms(2, 6000) + RESHAPE_MS) * ms)
    assert v.token_ops.at(1000) == pytest.approx((3 * layer_ms(1000) + op_ms("emb", 1000)) * ms)
    assert v.allreduce.at(1000 * 128) == pytest.approx(allreduce_ms(1000 * 128) * ms)
    # the 128-token chunk profiled only at KV 0 takes the 64-token chunk's rate per attended pair
    assert v.prefill.slopes[3] == pytest.approx(2 * v.prefill.slopes[2])
    # more decode requests than profiled: the largest batch's time per request
    assert v.decode_attention((64,) * 16) == pytest.approx(2 * v.decode_attention((64,) * 8))
    # a chunk past the largest profiled one: 128-token pieces, each over what precedes it
    launch = v.prefill.values[0][0]
    pieces = (v.prefill.at(128, 10) + v.prefill.at(128, 138) + v.prefill.at(44, 266)
              - 2 * launch)
    assert v.prefill_attention((300,), (10,)) == pytest.approx(pieces)


# ---- Vidur 0.0.26's rules ----

def test_token_counts_round_up_to_eight(profile_dir):
    """Token-level operators and all-reduces see the step's new tokens rounded up to a multiple
    of 8 (Vidur's ``Batch._total_num_q_tokens_rounded``); attention sees the tokens as they are."""
    v, L, ms = vidur(profile_dir), MODEL.num_layers, 1e-3
    parts = v.parts(StepShape.decode([64] * 3))  # 3 tokens: priced as 8
    assert parts.token_ops == pytest.approx((L * layer_ms(8) + op_ms("emb", 8)) * ms)
    assert parts.all_reduce == pytest.approx(2 * L * allreduce_ms(8 * 128) * ms)
    assert parts.attention == pytest.approx(L * (decode_ms(3, 64) + RESHAPE_MS) * ms)
    parts = v.parts(StepShape((9, 8), (0, 0)))  # 17 tokens: 24, between the profiled 16 and 32
    assert parts.token_ops == pytest.approx((L * layer_ms(24) + op_ms("emb", 24)) * ms)
    assert parts.all_reduce == pytest.approx(2 * L * allreduce_ms(24 * 128) * ms)


def test_decode_kv_is_the_truncated_mean_rounded_up_to_the_granularity(profile_dir):
    """Vidur's ``_get_batch_decode_attention_params``: int(mean KV), rounded up to
    ``kv_cache_prediction_granularity``."""
    v, ms = vidur(profile_dir, kv_granularity=32), 1e-3
    assert v.decode_attention((33, 40)) == pytest.approx((decode_ms(2, 64) + RESHAPE_MS) * ms)
    assert v.decode_attention((64, 65)) == pytest.approx((decode_ms(2, 64) + RESHAPE_MS) * ms)
    assert v.decode_attention((64, 66)) == pytest.approx((decode_ms(2, 96) + RESHAPE_MS) * ms)
    plain = vidur(profile_dir)  # granularity 1: the truncated mean itself
    assert plain.decode_attention((64, 67)) == pytest.approx((decode_ms(2, 65) + RESHAPE_MS) * ms)


def test_cascade_decode_is_priced_at_the_mean_kv_read(profile_dir):
    """Cascade (``StepShape.shared``): the decode kernel at the mean of the KV the batch reads,
    each shared prefix once: (110 + 110 + 40 − 100) // 3 = 53, not (260) // 3 = 86."""
    v, ms, L = vidur(profile_dir), 1e-3, MODEL.num_layers
    plain = StepShape.decode([110, 110, 40])
    cascade = StepShape.decode([110, 110, 40], shared=[(100, [0, 1])])
    assert v.parts(plain).attention == pytest.approx(L * (decode_ms(3, 86) + RESHAPE_MS) * ms)
    assert v.parts(cascade).attention == pytest.approx(L * (decode_ms(3, 53) + RESHAPE_MS) * ms)
    same = ("token_ops", "all_reduce", "overhead")
    assert [getattr(v.parts(cascade), k) for k in same] == [getattr(v.parts(plain), k)
                                                             for k in same]


def test_prefill_context_rounds_up_to_the_granularity(profile_dir):
    """Each chunk's cached context is rounded up as Vidur's ``_get_batch_prefill_attention_params``
    rounds its KV; nothing cached stays nothing."""
    v, ms = vidur(profile_dir, kv_granularity=32), 1e-3
    assert v.prefill_attention((16,), (33,)) == pytest.approx((prefill_ms(16, 64) + RESHAPE_MS) * ms)
    assert v.prefill_attention((16,), (0,)) == pytest.approx((prefill_ms(16, 0) + RESHAPE_MS) * ms)
    launch = (prefill_ms(16, 0) + RESHAPE_MS) * ms
    assert v.prefill_attention((16, 32), (1, 64)) == pytest.approx(
        (prefill_ms(16, 32) + prefill_ms(32, 64) + 2 * RESHAPE_MS) * ms - launch)


def test_decode_batching_overhead_for_gqa_batches(tmp_path):
    """Decode attention × (1 + overhead) for batches of two or more, in GQA models only (Vidur's
    ``attention_decode_batching_overhead_fraction``)."""
    gqa = vidur(write_profile(tmp_path / "gqa"), decode_batching_overhead=0.1)
    one, two = (decode_ms(b, 64) + RESHAPE_MS for b in (1, 2))
    assert gqa.decode_attention((64,)) == pytest.approx(one / 1e3)
    assert gqa.decode_attention((64, 64)) == pytest.approx(1.1 * two / 1e3)
    mha = ModelShape("mha", 3, 64, 4, 4, 16, 128, 256, tp=2)
    plain = vidur(write_profile(tmp_path / "mha", mha), mha, decode_batching_overhead=0.1)
    assert plain.decode_attention((64, 64)) == pytest.approx(two / 1e3)


def test_nccl_launch_per_all_reduce(profile_dir):
    """Every all-reduce (two per layer) adds Vidur's ``nccl_cpu_launch_overhead_ms``."""
    v, L = vidur(profile_dir, nccl_launch_s=2e-5), MODEL.num_layers
    assert v.parts(StepShape((32,), (0,))).all_reduce == pytest.approx(
        2 * L * (allreduce_ms(32 * 128) / 1e3 + 2e-5))


def test_a_step_with_vidurs_defaults(profile_dir):
    """All rules at once, Vidur's values (KV granularity 256, overhead 0.1, launch 20 µs): a decode
    step of three requests at 100, 120 and 140 tokens, by hand (the linear profile extrapolates
    exactly past its 128 tokens of KV)."""
    v = VidurCostModel(load_vidur_profile(profile_dir, MODEL), MODEL)
    L, ms = MODEL.num_layers, 1e-3
    expected = (L * layer_ms(8) + op_ms("emb", 8) + L * 1.1 * (decode_ms(3, 256) + RESHAPE_MS)
                + 2 * L * (allreduce_ms(8 * 128) + 0.02)) * ms
    assert v.step_time(StepShape.decode([100, 120, 140])) == pytest.approx(expected)


@pytest.mark.parametrize("key, value, message", [
    ("kv_granularity", 0, "cost_model.kv_granularity must be a whole number >= 1, got 0"),
    ("kv_granularity", 2.5, "cost_model.kv_granularity must be a whole number >= 1, got 2.5"),
    ("decode_batching_overhead", -0.1, "cost_model.decode_batching_overhead must be >= 0"),
    ("nccl_launch_s", -1e-6, "cost_model.nccl_launch_s must be >= 0"),
])
def test_bad_rule_values_are_refused(profile_dir, key, value, message):
    with pytest.raises(ValueError, match=message):
        vidur(profile_dir, **{key: value})


def test_a_cached_prefix_costs_its_attention_only(profile_dir):
    """A chunk of n over c cached tokens: cheaper than recomputing all n + c, dearer than the
    same chunk with nothing cached (Vidur's own predictor cannot tell the last two apart)."""
    v = vidur(profile_dir)
    for n, c in ((16, 64), (32, 32), (100, 500), (300, 4000)):
        cached = v.step_time(StepShape((n,), (c,)))
        assert v.step_time(StepShape((n,), (0,))) < cached < v.step_time(StepShape((n + c,), (0,)))


def check_monotone(v: VidurCostModel, pairs, which: int, grow: str, by: int) -> None:
    """One more unit of ``grow`` (a chunk's new tokens, a context, a decode request) never makes
    the step cheaper."""
    new, ctx = [max(n, 2) for n, _ in pairs], [c for _, c in pairs]
    i = which % len(pairs)
    if grow == "new":
        more = new.copy()
        more[i] += by
        assert v.step_time(StepShape(more, ctx)) >= v.step_time(StepShape(new, ctx))
    elif grow == "context":
        more = ctx.copy()
        more[i] += by
        assert v.step_time(StepShape(new, more)) >= v.step_time(StepShape(new, ctx))
    elif grow == "decode_context":
        more = ctx.copy()
        more[i] += by
        assert v.step_time(StepShape.decode(more)) >= v.step_time(StepShape.decode(ctx))
    else:  # one more decode request at the batch's mean context
        same = [sum(ctx) // len(ctx)] * len(ctx)
        assert v.step_time(StepShape.decode(same + same[:1])) >= v.step_time(StepShape.decode(same))


growth = st.sampled_from(["new", "context", "decode_context", "batch"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(0, 3000)), min_size=1, max_size=6),
       st.integers(0, 5), growth, st.integers(1, 40))
def test_monotone_in_tokens_and_kv(tmp_path_factory, pairs, which, grow, by):
    check_monotone(vidur(write_profile(tmp_path_factory.mktemp("p"))), pairs, which, grow, by)


# ---- config ----

def test_made_from_config_with_vidurs_defaults(profile_dir):
    """conf/cost_model/vidur.yaml: Vidur's rules, no per-step overhead; ``overhead_s: null`` takes
    the hardware's."""
    hw = hardware_spec(yaml.safe_load((REPO / "conf/hardware/a100.yaml").read_text()))
    cfg = yaml.safe_load((REPO / "conf/cost_model/vidur.yaml").read_text())
    with pytest.raises(ValueError, match="cost_model.profile_dir is required with cost_model="):
        COST_MODELS.build(cfg, model=MODEL, hw=hw)
    made = COST_MODELS.build(cfg | {"profile_dir": str(profile_dir)}, model=MODEL, hw=hw)
    assert isinstance(made, VidurCostModel) and made.overhead_s == 0.0
    assert (made.kv_granularity, made.decode_batching_overhead, made.nccl_launch_s) == (
        256, 0.1, 2e-5)
    h100 = hardware_spec(yaml.safe_load((REPO / "conf/hardware/h100.yaml").read_text()))
    made = COST_MODELS.build(cfg | {"profile_dir": str(profile_dir), "overhead_s": None}, model=MODEL, hw=h100)
    assert made.overhead_s == h100.step_overhead_s == 2e-3
    made = COST_MODELS.build({"name": "vidur", "profile_dir": str(profile_dir),
                              "kv_granularity": 16, "nccl_launch_s": 0}, model=MODEL, hw=hw)
    assert (made.kv_granularity, made.nccl_launch_s) == (16, 0.0)
    with pytest.raises(ProfileError, match="cost_model.profile_dir: no such directory"):
        COST_MODELS.build(cfg | {"profile_dir": str(profile_dir / "nope")}, model=MODEL, hw=hw)


def test_a_run_with_the_codellama_preset(tmp_path):
    """model=codellama_34b hardware=a100 cost_model=vidur through `testbed.run`, on a profile of
    CodeLlama-34B's shape written here; a profile of another shape stops the run with one line."""
    codellama = model_spec(yaml.safe_load((REPO / "conf/model/codellama_34b.yaml").read_text()))
    d = write_profile(tmp_path / "codellama", codellama)
    out = tmp_path / "run"
    common = ["backend=sim", "model=codellama_34b", "hardware=a100", "cost_model=vidur",
              "workload=few_shot", "workload.num_tasks=2", "workload.questions_per_task=3",
              "progress=false"]
    proc = subprocess.run([sys.executable, "-m", "testbed.run", *common,
                           f"cost_model.profile_dir={d}", f"hydra.run.dir={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "codellama_34b" and summary["num_requests"] == 2 * 3
    assert summary["makespan_s"] > 0
    proc = subprocess.run([sys.executable, "-m", "testbed.run", *common,
                           f"cost_model.profile_dir={write_profile(tmp_path / 'small')}",
                           f"hydra.run.dir={tmp_path / 'refused'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "model=codellama_34b needs n_embd=8192" in proc.stderr


# ---- the real profile (data:vidur_a100_codellama34b_tp2: A100, CodeLlama-34B, TP2) ----

@pytest.fixture(scope="module")
def real() -> VidurCostModel:
    m = model_spec(yaml.safe_load((REPO / "conf/model/codellama_34b.yaml").read_text()))
    profile = vidur_profile()
    return VidurCostModel(load_vidur_profile(profile, m), m)  # Vidur's rules, as cost_model=vidur


def test_real_profile_close_to_every_measurement(real):
    """The isotonic fit equals the measurements where they are in order and stays close where a
    larger shape measured faster (figures in testbed/sim/monotone.py)."""
    p = real.profile
    measured = real.model.num_layers * p.layer_s() + p.ops["emb"]
    fitted = np.array([real.token_ops.at(t) for t in p.tokens])
    assert np.mean(np.isclose(fitted, measured, rtol=1e-9, atol=0)) > 0.25
    assert np.abs(fitted / measured - 1).max() < 0.05
    seen = np.isfinite(p.prefill.values)
    grid = np.array([[real.prefill.at(n, c) for c in p.prefill.cols] for n in p.prefill.rows])
    assert np.mean(np.isclose(grid[seen], p.prefill.values[seen], rtol=1e-9, atol=0)) > 0.25
    assert abs(np.mean(grid[seen] / p.prefill.values[seen] - 1)) < 0.01


def test_real_profile_prices_a_cached_prefix(real):
    for n, c in ((512, 3000), (2048, 30000), (64, 100000)):
        cached = real.step_time(StepShape((n,), (c,)))
        assert real.step_time(StepShape((n,), (0,))) < cached < real.step_time(
            StepShape((n + c,), (0,)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9000), st.integers(0, 120000)), min_size=1, max_size=8),
       st.integers(0, 7), growth, st.integers(1, 40))
def test_real_profile_monotone(real, pairs, which, grow, by):
    check_monotone(real, pairs, which, grow, by)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8192), st.integers(0, 120000)), min_size=1, max_size=8),
       st.booleans())
def test_real_profile_never_below_the_roofline_floor(real, pairs, decode):
    hw = hardware_spec(yaml.safe_load((REPO / "conf/hardware/a100.yaml").read_text()))
    floor = RooflineCostModel(real.model, hw)
    new = [1] * len(pairs) if decode else [n for n, _ in pairs]
    step = StepShape(new, [c for _, c in pairs])
    assert real.step_time(step) >= floor.floor(step)
