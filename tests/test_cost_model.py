"""Model/hardware specs, KV capacity, and the roofline and fitted step-time models."""

from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.config.model_shape import ModelShape
from testbed.sim.cost_model import (
    FittedCostModel, RooflineCostModel, StepShape, load_fitted, COST_MODELS, save_fitted,
)
from testbed.sim.roofline_fit import grid_steps, loaded_steps, ratios
from tests.conftest import vidur_profile
from testbed.sim.specs import (
    HardwareSpec, hardware_spec, kv_capacity_tokens, mem_fraction, model_spec,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
KiB = 1024


def conf(group: str, name: str) -> dict:
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


def model(name: str) -> ModelShape:
    return model_spec(conf("model", name))


def hw(name: str) -> HardwareSpec:
    return hardware_spec(conf("hardware", name))


def zero_coeffs() -> dict:
    return {kind: dict.fromkeys("abcde", 0.0) for kind in ("decode", "prefill")}


# ---- specs ----

@pytest.mark.parametrize("name, kib", [("llama2_7b", 512), ("llama3_8b", 128), ("llama3_70b", 320),
                                       ("codellama_34b", 192)])
def test_kv_bytes_per_token(name, kib):
    """2 · layers · kv_heads · head_dim · 2 bytes: 512 / 128 / 320 KiB (docs/design.md §6), 192 KiB
    for CodeLlama-34B (48 layers, 8 KV heads)."""
    m = model(name)
    assert m.kv_bytes_per_token == kib * KiB
    assert m.kv_bytes_per_token_per_gpu == kib * KiB // m.tp


@pytest.mark.parametrize("name, published, exact", [
    ("llama2_7b", 6.74e9, 6_738_415_616),  # published: 6.74B, 8.03B, 70.6B (model cards)
    ("llama3_8b", 8.03e9, 8_030_261_248),
    ("llama3_70b", 70.6e9, 70_553_706_496),
    ("codellama_34b", 34e9, 33_743_970_304),  # model card: "34B"
])
def test_param_counts(name, published, exact):
    """Matmuls + untied embedding and LM head + RMSNorm weights = the checkpoints' counts."""
    m = model(name)
    assert m.params == pytest.approx(published, rel=0.01)
    assert m.params == exact
    assert m.weight_bytes_per_gpu == m.params * 2 // m.tp


def test_linear_params_by_hand():
    """Per layer q,o = 2·h·heads·hd, k,v = 2·h·kv·hd, SwiGLU = 3·h·ffn; plus the LM head."""
    m = ModelShape("t", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=10)
    per_layer = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16
    assert m.linear_params == 2 * per_layer + 10 * 8
    assert m.params == m.linear_params + 10 * 8 + 5 * 8


def test_kv_capacity_arithmetic():
    """(memory · fraction − weights per GPU) / KV bytes per token per GPU, floored."""
    m = ModelShape("t", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4,
                   intermediate_size=16, vocab_size=10, dtype_bytes=2, tp=2)
    layer = 2 * 8 * 8 + 2 * 8 * 8 + 3 * 8 * 16  # q,o + k,v + gate,up,down
    assert m.params == 2 * layer + 2 * 10 * 8 + 5 * 8 == 1480
    assert m.weight_bytes_per_gpu == 1480 * 2 // 2
    assert m.kv_bytes_per_token_per_gpu == 2 * 2 * 1 * 4 * 2 == 32  # one KV head per rank
    h = HardwareSpec("h", flops=1.0, mem_bw=1.0, memory_bytes=10_000)
    assert kv_capacity_tokens(m, h, mem_fraction=0.5) == (5000 - 1480) // 32 == 110
    assert kv_capacity_tokens(m, h) == (9000 - 1480) // 32 == 235
    with pytest.raises(ValueError, match="model does not fit: weights .* > memory × mem_fraction"):
        kv_capacity_tokens(m, HardwareSpec("small", 1.0, 1.0, memory_bytes=1000))


def test_preset_capacities():
    """The presets give plausible pools; a 70B model does not fit an A10G."""
    assert 10_000 < kv_capacity_tokens(model("llama2_7b"), hw("a10g")) < 20_000
    assert kv_capacity_tokens(model("llama3_8b"), hw("h100")) > 400_000
    assert kv_capacity_tokens(model("llama3_70b"), hw("h100")) > 400_000
    with pytest.raises(ValueError, match="does not fit"):
        kv_capacity_tokens(model("llama3_70b"), hw("a10g"))


@pytest.mark.parametrize("path", sorted((CONF / "model").glob("[!_]*.yaml")), ids=lambda p: p.stem)
def test_model_configs_load(path):
    cfg = yaml.safe_load(path.read_text())
    m = model_spec(cfg)
    assert m.name == path.stem and "path" in cfg
    assert m.num_heads * m.head_dim == m.hidden_size


@pytest.mark.parametrize("path", sorted((CONF / "hardware").glob("*.yaml")), ids=lambda p: p.stem)
def test_hardware_configs_load(path):
    cfg = yaml.safe_load(path.read_text())
    h = hardware_spec(cfg)
    assert h.name == path.stem and mem_fraction(cfg) == 0.9
    assert h.interconnect_bw == cfg["interconnect_bw"] > 0 and "step_overhead_s" in cfg
    assert h.step_overhead_s > 0 or h.name == "a100"  # the A100's: Vidur's, none (cost_model.py)
    assert kv_capacity_tokens(model("tiny"), h, mem_fraction(cfg)) > 0


@pytest.mark.parametrize("key, value, message", [
    ("num_layers", 0, "model.num_layers must be >= 1, got 0"),
    ("num_layers", None, "model.num_layers is required"),
    ("hidden_size", 2.5, "model.hidden_size must be an integer >= 1, got 2.5"),
    ("num_kv_heads", 3, r"model.num_heads \(32\) must be a multiple of model.num_kv_heads \(3\)"),
    ("tp", 3, r"model.tp must divide model.num_heads \(32\), got 3"),
    ("dtype_bytes", 3, "model.dtype_bytes must be one of 1, 2, 4; got 3"),
    ("name", "", "model.name must be a non-empty string"),
])
def test_bad_model_config(key, value, message):
    cfg = conf("model", "llama3_8b") | {key: value}
    with pytest.raises(ValueError, match=message):
        model_spec(cfg)


@pytest.mark.parametrize("key, value, message", [
    ("flops", -1.0, "hardware.flops must be > 0, got -1"),
    ("interconnect_bw", None, r"hardware.interconnect_bw is required: per-direction bytes/s"),
    ("interconnect_bw", 0.0, "hardware.interconnect_bw must be > 0, got 0"),
    ("step_overhead_s", None, r"hardware.step_overhead_s is required: the host's CPU"),
    ("step_overhead_s", -1e-3, "hardware.step_overhead_s must be >= 0, got -0.001"),
    ("mem_bw", "2e12", r"hardware.mem_bw must be a number, got '2e12' \(YAML reads"),
    ("memory_bytes", 0, "hardware.memory_bytes must be >= 1, got 0"),
    ("mem_fraction", 1.5, r"hardware.mem_fraction must be in \(0, 1\], got 1.5"),
])
def test_bad_hardware_config(key, value, message):
    cfg = conf("hardware", "h100") | {key: value}
    with pytest.raises(ValueError, match=message):
        hardware_spec(cfg)


# ---- step shapes ----

def test_step_shape():
    s = StepShape(new=[1, 1, 512], context=[100, 200, 0])
    assert (s.batch, s.num_new, s.num_context, s.new_times_context) == (3, 514, 300, 300)
    assert not s.is_decode and s.kind == "prefill"  # a mixed step counts as prefill
    assert s.attended_pairs == 300 + 1 + 1 + 512 * 513 / 2
    d = StepShape.decode([5, 7])
    assert d.is_decode and d.kind == "decode" and d.new == (1, 1)
    for bad in [((), ()), ((1,), (1, 2)), ((0,), (3,)), ((1,), (-1,))]:
        with pytest.raises(ValueError, match="StepShape"):
            StepShape(*bad)


def test_step_shape_shared_prefixes():
    """Cascade groups (P, members): the step reads Σcontext − Σ(members − 1)·P cached tokens."""
    s = StepShape.decode([110, 110, 40, 120, 130, 125], shared=[(100, [0, 1]), (30, (3, 4, 5))])
    assert s.shared == ((100, (0, 1)), (30, (3, 4, 5)))
    assert (s.num_context, s.shared_saving, s.kv_read_context) == (635, 160, 475)
    assert StepShape.decode([5, 7]).kv_read_context == 12
    for bad in [((110, 110), [(100, [0])]),            # a group of one
                ((110, 110), [(100, [0, 0])]),         # a request twice
                ((110, 110, 90), [(50, [0, 1]), (50, [1, 2])]),  # groups overlap
                ((110, 110), [(100, [0, 2])]),         # not in the batch
                ((110, 90), [(100, [0, 1])]),          # longer than a member's cached KV
                ((110, 110), [(0, [0, 1])])]:
        with pytest.raises(ValueError, match="StepShape"):
            StepShape.decode(*bad)
    with pytest.raises(ValueError, match="decode steps only"):
        StepShape(new=(1, 2), context=(110, 110), shared=[(100, [0, 1])])


def two_sharing_a_prefix(alone: tuple[int, ...] = ()) -> tuple[StepShape, StepShape]:
    """Two decode requests on one cached 100-token prefix with 10-token suffixes (and any
    requests ``alone``), from the radix tree's own grouping: plain and cascade."""
    from testbed.cache import RadixCache
    from testbed.cache.shared_prefix import shared_prefix_groups

    cache = RadixCache(1000)
    prefix = np.arange(1000, 1100, dtype=np.int32)
    seqs = [np.concatenate([prefix, np.arange(b, b + 10, dtype=np.int32)]) for b in (2000, 3000)]
    for seq in seqs:
        lease = cache.acquire(seq)
        cache.extend(lease, len(seq) - lease.hit)
        cache.release(lease, seq)
    leases = [cache.acquire(seq) for seq in seqs] + [None] * len(alone)
    groups = shared_prefix_groups(leases)
    assert groups == [(100, [0, 1])]
    contexts = (110, 110, *alone)
    return StepShape.decode(contexts), StepShape.decode(contexts, shared=groups)


@pytest.mark.parametrize("alone", [(), (300,), (50, 4000)])
def test_roofline_cascade_reads_a_shared_prefix_once(alone):
    """The pair's 100 shared tokens are read once, not twice: exactly 100 tokens' KV fewer bytes,
    whatever else is in the batch (a request alone reads what it read); same FLOPs."""
    r = roofline("llama2_7b", "a10g")
    plain, cascade = two_sharing_a_prefix(alone)
    kv = r.model.kv_bytes_per_token_per_gpu
    assert r.bytes(plain) - r.bytes(cascade) == 100 * kv
    assert r.bytes(cascade) == r._weight_bytes + kv * (100 + 2 * 11 + sum(c + 1 for c in alone)
                                                       + cascade.num_new)
    assert r.flops(cascade) == r.flops(plain)
    assert r.step_time(cascade) < r.step_time(plain)  # decode on an A10G is memory-bound
    assert r.step_time(cascade) == pytest.approx(r.step_time(plain) - 100 * kv / (
        r.hw.mem_bw * r.mbu), rel=1e-12)
    assert r.floor(cascade) < r.floor(plain)


def test_without_groups_the_price_is_unchanged():
    """No group (cascade off, or nobody shares): the same number, to the bit, as before."""
    r = roofline("llama2_7b", "a10g")
    step = StepShape.decode([110, 110, 300])
    kv = r.model.kv_bytes_per_token_per_gpu
    assert r.bytes(step) == r._weight_bytes + kv * (step.num_context + 2 * step.num_new)
    assert r.bytes(StepShape.decode([110, 110, 300], shared=())) == r.bytes(step)


def test_fitted_e_term_counts_a_shared_prefix_once():
    coeffs = {"decode": {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "e": 5.0},
              "prefill": dict.fromkeys("abcde", 0.0)}
    fitted = FittedCostModel(coeffs, roofline("llama2_7b", "a10g"))
    plain, cascade = two_sharing_a_prefix()
    assert fitted.predict(plain) - fitted.predict(cascade) == 5 * 100
    assert cascade.attended_pairs == plain.attended_pairs  # c: the same attention math


# ---- roofline ----

def roofline(name="llama3_8b", device="h100", **kw) -> RooflineCostModel:
    return RooflineCostModel(model(name), hw(device), **kw)


def compute_time(r: RooflineCostModel, step: StepShape) -> float:
    return (r.matmul_flops(step) / (r.hw.flops * r.mfu)
            + r.attention_flops(step) / (r.hw.flops * r.attn_mfu))


def test_roofline_decode_is_memory_bound_and_grows_with_context():
    r = roofline()
    step = StepShape.decode([1000] * 32)
    memory = r.bytes(step) / (r.hw.mem_bw * r.mbu)
    assert memory > 5 * compute_time(r, step)
    assert r.step_time(step) == pytest.approx(memory + r.overhead_s)
    longer, wider = StepShape.decode([4000] * 32), StepShape.decode([1000] * 64)
    assert r.step_time(longer) > r.step_time(step)
    assert r.step_time(wider) > r.step_time(step)
    kv = r.model.kv_bytes_per_token_per_gpu
    assert r.bytes(longer) - r.bytes(step) == 32 * 3000 * kv


def test_roofline_large_prefill_is_compute_bound():
    """Every layer's matmuls for each of the 2,048 tokens, the LM head for the last one only,
    attention over the causal triangle at its own efficiency."""
    r = roofline()
    step = StepShape(new=(2048,), context=(0,))
    compute = compute_time(r, step)
    assert compute > 5 * r.bytes(step) / (r.hw.mem_bw * r.mbu)
    layers = 2 * 32 * r.model.layer_linear_params * 2048
    lm_head = 2 * 128256 * 4096
    attention = 4 * 32 * 32 * 128 * 2048 * 2049 // 2
    assert (r.matmul_flops(step), r.attention_flops(step)) == (layers + lm_head, attention)
    assert r.flops(step) == layers + lm_head + attention
    assert r.step_time(step) == pytest.approx(
        (layers + lm_head) / (989e12 * 0.65) + attention / (989e12 * 0.23) + 2e-3, rel=1e-12)


def test_lm_head_counted_once_per_request():
    """The LM head runs on each request's last new position (as the engine computes it), whether
    its chunk is the prompt's last or not: a 512-token chunk costs it once, like a decode."""
    m = ModelShape("t", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=10, tp=2)
    r = RooflineCostModel(m, HardwareSpec("h", 1.0, 1.0, 1, interconnect_bw=1.0))
    per_layer = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16
    step = StepShape(new=(512, 1, 1), context=(0, 10, 20))
    assert r.matmul_flops(step) == 2 * 2 * per_layer * 514 / 2 + 2 * 10 * 8 * 3 / 2
    assert r.attention_flops(step) == 4 * 2 * 2 * 4 * (512 * 513 / 2 + 11 + 21) / 2


def test_attention_runs_at_its_own_efficiency():
    """Halving attn_mfu doubles the attention term and leaves the matmuls' alone."""
    step = StepShape(new=(4096,), context=(8192,))
    a, b = roofline(attn_mfu=0.4, overhead_s=0.0), roofline(attn_mfu=0.2, overhead_s=0.0)
    attention = a.attention_flops(step) / (989e12 * 0.4)
    assert b.step_time(step) - a.step_time(step) == pytest.approx(attention, rel=1e-9)
    assert a.step_time(step) == pytest.approx(a.matmul_flops(step) / (989e12 * 0.65) + attention)


@pytest.mark.parametrize("device, bw, overhead", [
    ("a100", 300e9, 0.0), ("h100", 450e9, 2e-3), ("h200", 450e9, 2e-3), ("a10g", 31.5e9, 2e-3),
    ("cpu", 20e9, 1e-3)])
def test_interconnect_and_overhead_come_from_the_hardware_preset(device, bw, overhead):
    r = roofline("llama3_70b", device)
    assert (r.interconnect_bw, r.overhead_s) == (bw, overhead)
    made = COST_MODELS.build(conf("cost_model", "roofline"), model=model("llama3_70b"), hw=hw(device))
    assert (made.interconnect_bw, made.overhead_s) == (bw, overhead)
    override = {"name": "roofline", "interconnect_bw": 100e9, "overhead_s": 0.0}
    made = COST_MODELS.build(override, model=model("llama3_70b"), hw=hw(device))
    assert (made.interconnect_bw, made.overhead_s) == (100e9, 0.0)


def test_tensor_parallel_needs_an_interconnect():
    bare = HardwareSpec("h", 1e12, 1e12, 10**11)
    assert RooflineCostModel(model("llama3_8b"), bare).overhead_s == 0.0  # tp 1: none needed
    with pytest.raises(ValueError, match="model.tp=4 needs hardware.interconnect_bw"):
        RooflineCostModel(model("llama3_70b"), bare)


def test_roofline_tensor_parallel_allreduce():
    """tp=1 has no all-reduce; at tp=4, 2·layers ring all-reduces of Σnew·hidden·2 bytes."""
    step = StepShape(new=(512,), context=(0,))
    assert roofline().allreduce_time(step) == 0
    r = roofline("llama3_70b", interconnect_bw=450e9)
    moved = 2 * 3 / 4 * 512 * 8192 * 2
    assert r.allreduce_time(step, latency_s=0) == pytest.approx(2 * 80 * moved / 450e9)
    assert r.floor(step) == pytest.approx(r.flops(step) / r.hw.flops + 2 * 80 * moved / 450e9)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 32768)), min_size=1, max_size=64),
       st.sampled_from(["tiny", "llama2_7b", "llama3_70b"]))
def test_floor_below_step_time(pairs, name):
    r = roofline(name)
    step = StepShape(new=[n for n, _ in pairs], context=[c for _, c in pairs])
    assert 0 < r.floor(step) < r.step_time(step)


# ---- fitted ----

coeff = st.one_of(st.just(0.0), st.floats(0, 1e-2), st.floats(0, 1e-6), st.floats(0, 1e-9))
coeff_row = st.fixed_dictionaries({c: coeff for c in "abcde"})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 32768)), min_size=1, max_size=64),
       st.fixed_dictionaries({"decode": coeff_row, "prefill": coeff_row}), st.booleans())
def test_fitted_never_below_floor(pairs, coeffs, decode):
    floor = roofline("llama3_70b")
    fitted = FittedCostModel(coeffs, floor)
    new = [1] * len(pairs) if decode else [n for n, _ in pairs]
    step = StepShape(new=new, context=[c for _, c in pairs])
    t = fitted.step_time(step)
    assert t >= floor.floor(step)
    assert t == max(fitted.predict(step), floor.floor(step))


def test_fitted_form_and_all_zero():
    floor = roofline()
    coeffs = {"decode": {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "e": 5.0},
              "prefill": {"a": 10.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 0.0}}
    fitted = FittedCostModel(coeffs, floor)
    step = StepShape.decode([10, 20])
    # c multiplies every attended query-key pair: Σ new·(context + (new+1)/2) = 30 + 2 for decode
    assert fitted.step_time(step) == 1 + 2 * 2 + 3 * 32 + 4 * 2 + 5 * 30
    assert fitted.step_time(StepShape(new=(1, 5), context=(3, 0))) == 10.0  # mixed → prefill
    zero = FittedCostModel(zero_coeffs(), floor)
    assert zero.step_time(step) == floor.floor(step) > 0


def test_fitted_yaml_round_trip(tmp_path):
    path = tmp_path / "fit.yaml"
    coeffs = {"decode": {"a": 4e-3, "b": 1e-6, "c": 2e-11, "d": 3e-6, "e": 1e-9, "f": 5e-10, "g": 2e-3,
                         "h": 2e-10},
              "prefill": {"a": 6e-3, "b": 1.5e-5, "c": 4e-10, "d": 0.0, "e": 2e-8, "f": 0.0, "g": 0.0,
                          "h": 2e-8}}
    save_fitted(path, coeffs, {"model": "llama3_8b", "device": "NVIDIA H100 80GB HBM3"})
    doc = yaml.safe_load(path.read_text())
    assert doc["meta"]["model"] == "llama3_8b" and len(doc["meta"]["date"]) == 10
    assert load_fitted(path, roofline()).coeffs == coeffs
    made = COST_MODELS.build({"name": "fitted", "path": str(path)}, model=model("llama3_8b"), hw=hw("h100"))
    assert isinstance(made, FittedCostModel) and made.coeffs == coeffs


def test_fitted_f_term_prices_a_decode_batch_padded_to_its_longest():
    floor = roofline()
    coeffs = {"decode": {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 2.0, "f": 3.0},
              "prefill": {"a": 10.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 0.0, "f": 7.0}}
    fitted = FittedCostModel(coeffs, floor)
    ragged = StepShape.decode([10, 100, 40])
    assert ragged.padded_decode_area == 3 * 100
    assert fitted.predict(ragged) == 1 + 2 * 150 + 3 * 300
    # uniform contexts: the padded area is Σcontext, the two terms coincide
    assert fitted.predict(StepShape.decode([50, 50])) == 1 + 2 * 100 + 3 * 100
    prefill = StepShape(new=(4, 1), context=(10, 100))  # prefills run unpadded: no f term
    assert prefill.padded_decode_area == 0 and fitted.predict(prefill) == 10.0


def test_a_cascade_decode_pads_its_suffixes_and_its_prefixes_each_to_their_longest():
    # requests 0 and 1 share 100 tokens (suffixes 10 and 30), request 2 is alone (40): suffixes
    # padded to 40 for 3 requests, one group's prefix of 100
    step = StepShape.decode([110, 130, 40], shared=((100, (0, 1)),))
    assert step.padded_decode_area == 3 * 40 + 1 * 100
    assert StepShape.decode([110, 130, 40]).padded_decode_area == 3 * 130


def test_fitted_g_term_prices_the_extra_weight_passes_of_two_or_three_rows():
    coeffs = {kind: {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 0.0, "f": 0.0, "g": 10.0}
              for kind in ("decode", "prefill")}
    fitted = FittedCostModel(coeffs, roofline())
    passes = {b: StepShape.decode([5] * b).few_row_passes for b in (1, 2, 3, 4, 16)}
    assert passes == {1: 0, 2: 1, 3: 2, 4: 0, 16: 0}
    assert [fitted.predict(StepShape.decode([5] * b)) for b in (1, 2, 3, 4)] == [1, 11, 21, 1]
    # a prefill's LM head has one row per request: the same count
    assert fitted.predict(StepShape(new=(64, 64, 64), context=(0, 0, 0))) == 21


def test_a_fitted_file_without_f_reads_as_f_zero(tmp_path):
    path = tmp_path / "old.yaml"
    coeffs = {"decode": {"a": 1e-3, "b": 0.0, "c": 0.0, "d": 0.0, "e": 1e-7},
              "prefill": {"a": 2e-3, "b": 1e-5, "c": 0.0, "d": 0.0, "e": 0.0}}
    path.write_text(yaml.safe_dump({"meta": {}, "coeffs": coeffs}))
    loaded = load_fitted(path, roofline())
    assert loaded.coeffs["decode"]["f"] == loaded.coeffs["prefill"]["g"] == 0.0
    assert loaded.predict(StepShape.decode([10, 1000])) == 1e-3 + 1e-7 * 1010
    shipped = load_fitted(CONF / "calibration" / "tiny_cpu.yaml", roofline())
    assert shipped.coeffs["decode"]["f"] == 0.0


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["prefill"].update(c=-1e-9), "coeffs.prefill.c must be >= 0"),
    (lambda c: c.pop("decode"), "missing coeffs.decode"),
    (lambda c: c["decode"].pop("e"), "missing coeffs.decode.e"),
    (lambda c: c["decode"].update(z=1.0), "unknown coeffs.decode keys"),
])
def test_bad_fitted_file(tmp_path, edit, message):
    coeffs = zero_coeffs()
    edit(coeffs)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"meta": {}, "coeffs": coeffs}))
    with pytest.raises(ValueError, match=f"bad.yaml: {message}"):
        load_fitted(path, roofline())


def test_cost_models_build_from_their_config_groups():
    m, h = model("llama3_8b"), hw("h100")
    r = COST_MODELS.build(conf("cost_model", "roofline"), model=m, hw=h)
    assert isinstance(r, RooflineCostModel)
    assert (r.mfu, r.attn_mfu, r.mbu, r.overhead_s) == (0.65, 0.23, 0.58, 2e-3)
    old_keys = {"name": "roofline", "mfu": 0.6, "mbu": 0.7, "overhead_s": 2e-3}  # before attn_mfu
    r = COST_MODELS.build(old_keys, model=m, hw=h)
    assert (r.mfu, r.attn_mfu, r.mbu, r.overhead_s) == (0.6, 0.23, 0.7, 2e-3)
    with pytest.raises(ValueError, match="cost_model.path is required"):
        COST_MODELS.build(conf("cost_model", "fitted"), model=m, hw=h)
    with pytest.raises(ValueError,
                       match="cost_model must be one of roofline, fitted, vidur, custom; got"):
        COST_MODELS.build({"name": "x"}, model=m, hw=h)
    with pytest.raises(ValueError, match=r"cost_model.mfu must be in \(0, 1\], got 1.5"):
        COST_MODELS.build({"name": "roofline", "mfu": 1.5}, model=m, hw=h)
    with pytest.raises(ValueError, match=r"cost_model.attn_mfu must be in \(0, 1\], got 0.0"):
        COST_MODELS.build({"name": "roofline", "attn_mfu": 0.0}, model=m, hw=h)
    with pytest.raises(ValueError, match="cost_model.path: no such file"):
        COST_MODELS.build({"name": "fitted", "path": "/nonexistent.yaml"}, model=m, hw=h)


# ---- against measurements ----

def test_roofline_against_vidur_a100():
    """Vidur's measured A100 operators (CodeLlama-34B, TP2) are never below the roofline floor, and
    the default roofline lands within the figures of cost_model.py's docstring of whole steps
    priced by those operators (VidurCostModel as Vidur 0.0.26 prices them, no per-step overhead),
    on the loaded steps it is fitted to and on single shapes."""
    pd = pytest.importorskip("pandas")
    vidur_dir = vidur_profile()
    # one layer of CodeLlama-34B per rank (Vidur times layers): only per-layer numbers are read
    layer = ModelShape("codellama34b-layer", num_layers=1, hidden_size=8192, num_heads=64,
                       num_kv_heads=8, head_dim=128, intermediate_size=22016, vocab_size=32000,
                       tp=2)
    a100 = hw("a100")
    med = lambda df, op: df[f"time_stats.{op}.median"] / 1e3  # noqa: E731  (ms → s)

    mlp = pd.read_csv(vidur_dir / "mlp.csv").groupby("num_tokens").median(numeric_only=True)
    matmuls = sum(med(mlp, op) for op in
                  ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"))
    T = mlp.index.to_numpy()
    matmul_floor = [max(2 * layer.layer_linear_params / 2 * t / a100.flops,
                        layer.layer_linear_params * 2 / 2 / a100.mem_bw) for t in T]
    ratio = matmuls / matmul_floor
    assert ratio.min() > 1.2 and ratio[T <= 64].max() < 1.4 and ratio[T >= 512].max() < 1.7

    att = pd.read_csv(vidur_dir / "attention.csv")
    heads, kv = layer.num_heads // 2, layer.kv_bytes_per_token_per_gpu

    def attention_floor(step):
        return max(4 * heads * 128 * step.attended_pairs / a100.flops,
                   kv * (step.num_context + 2 * step.num_new) / a100.mem_bw)

    pre = att[att.is_prefill]
    pre_ratio = med(pre, "attn_prefill") / [
        attention_floor(StepShape((c,), (k,)))
        for c, k in zip(pre.prefill_chunk_size, pre.kv_cache_size)]
    dec = att[~att.is_prefill]
    dec_ratio = med(dec, "attn_decode") / [
        attention_floor(StepShape.decode([k] * b))
        for b, k in zip(dec.batch_size, dec.kv_cache_size)]
    assert pre_ratio.min() > 2 and 3.5 < pre_ratio.median() < 5
    assert dec_ratio.min() > 1.1

    # whole steps: roofline (defaults, no overhead) / Vidur's operators
    from testbed.sim.vidur_cost import VidurCostModel
    from testbed.sim.vidur_profile import load_vidur_profile

    m = model("codellama_34b")
    vidur = VidurCostModel(load_vidur_profile(vidur_dir, m), m, overhead_s=0.0)
    roof = RooflineCostModel(m, a100, overhead_s=0.0)
    grid = vidur.profile.prefill
    seen = np.isfinite(grid.values)
    pairs = sum(StepShape((int(n),), (int(c),)).attended_pairs
                for i, n in enumerate(grid.rows) for j, c in enumerate(grid.cols) if seen[i, j])
    assert 4 * 32 * 128 * pairs / (a100.flops * grid.values[seen].sum()) == pytest.approx(
        roof.attn_mfu, abs=0.005)

    shapes = grid_steps()
    decode, fresh, cached = (ratios(roof, vidur, shapes[kind]) for kind in (
        "decode, 1-128 requests", "prefill, nothing cached", "prefill over a cache"))
    assert 0.9 < decode.min() and decode.max() < 1.19 and 1.1 < np.median(decode) < 1.17
    assert 0.93 < fresh.min() and fresh.max() < 1.09
    assert 0.94 < cached.min() and cached.max() < 1.13
    fit = {kind: ratios(roof, vidur, steps) for kind, steps in loaded_steps().items()}
    loaded_decode, loaded_prefill = fit.values()
    assert 0.94 < loaded_decode.min() and loaded_decode.max() < 1.07
    assert 0.99 < np.median(loaded_decode) < 1.03 and 0.99 < np.median(loaded_prefill) < 1.03
    assert 0.81 < loaded_prefill.min() and loaded_prefill.max() < 1.07


def test_a_steps_reread_is_decode_kv_it_reads_at_most_and_never_moves_the_roofline():
    assert StepShape.decode((30, 30), reread=30).reread == 30
    for bad in ({"new": (4, 1), "context": (30, 30), "reread": 5},  # a prefill
                {"new": (1, 1), "context": (30, 30), "reread": 61},  # more than it reads
                {"new": (1, 1), "context": (30, 30), "reread": -1}):
        with pytest.raises(ValueError, match="reread must be 0, or in a decode step"):
            StepShape(**bad)
    r = roofline()
    assert r.step_time(StepShape.decode((300, 300), reread=300)) == \
        r.step_time(StepShape.decode((300, 300)))
