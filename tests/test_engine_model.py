"""The engine against HF transformers (fp32, CPU, tiny shapes): logits, prefix reuse, greedy
generation through the real scheduler and radix cache, checkpoint loading, sampling."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

from testbed.cache import BlockHashCache, RadixCache  # noqa: E402
from testbed.cache.base import Lease  # noqa: E402
from testbed.engine import attention as attention_module  # noqa: E402
from testbed.engine.attention import TorchAttention  # noqa: E402
from testbed.engine.metadata import AttentionMetadata  # noqa: E402
from testbed.engine.executor import EngineExecutor, make_engine_executor  # noqa: E402
from testbed.engine.kv_cache import KVCache  # noqa: E402
from testbed.engine.loader import (build_model, check_model_group, config_from_model_group,  # noqa: E402
                                   load_model, load_state_dict,
                                   save_random_hf_model, tiny_config)
from testbed.engine.model import LlamaModel  # noqa: E402
from testbed.errors import BadInput  # noqa: E402
from testbed.engine.runner import ModelRunner  # noqa: E402
from testbed.engine.sampler import Sampler, sample  # noqa: E402
from testbed.config.model_shape import ModelShape  # noqa: E402
from testbed.scheduler.batch import Batch, BatchEntry  # noqa: E402
from testbed.scheduler.request_state import Req  # noqa: E402
from testbed.sim.executor import StepOutcome, predetermined_tokens  # noqa: E402
from testbed.serving.serve import serve  # noqa: E402
from testbed.workloads.request import OutputRef, Request  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4


def hf_model(config, seed: int = 0):
    """A random HF causal LM with eager attention (the reference)."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def ours_from(hf) -> LlamaModel:
    model = LlamaModel(ModelShape.from_hf(hf.config))
    load_state_dict(model, hf.state_dict())
    return model.eval()


def hf_last_logits(hf, prompt) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([list(prompt)])).logits[0, -1]


def hf_greedy(hf, prompt, n: int) -> list[int]:
    ids = torch.tensor([list(prompt)])  # with a mask of ones: token 0 in a prompt is no padding
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_req(rid: str, prompt, slots, out: int = 1) -> Req:
    request = Request(rid, np.asarray(prompt, dtype=np.int32), np.zeros(out, dtype=np.int32))
    req = Req(request=request, prompt=request.prompt, submitted_s=0.0, seq=0)
    req.lease = Lease(hit=0, slots=np.asarray(slots, dtype=np.int32))
    return req


@pytest.fixture(scope="module")
def tiny_hf():
    return hf_model(tiny_config())


@pytest.fixture(scope="module")
def tiny_ours(tiny_hf):
    return ours_from(tiny_hf)


def prompts_sharing_prefixes(seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 40).tolist()  # above the scheduler's 32-token deferral threshold
    short = rng.integers(0, 256, 12).tolist()
    return [system + rng.integers(0, 256, 9).tolist(),
            system + rng.integers(0, 256, 5).tolist(),
            short + rng.integers(0, 256, 7).tolist(),
            system + rng.integers(0, 256, 14).tolist(),
            short + rng.integers(0, 256, 3).tolist(),
            rng.integers(0, 256, 17).tolist()]


# ---------------------------------------------------------------------------- logits vs HF
def test_full_prompts_in_one_batch_give_hfs_last_token_logits(tiny_hf, tiny_ours):
    """Three prompts of different lengths in one flattened prefill step: each row equals HF."""
    prompts = prompts_sharing_prefixes()[:3]
    runner = ModelRunner(tiny_ours, num_slots=200)
    slots = np.random.default_rng(0).permutation(np.arange(1, 201))
    entries, used = [], 0
    for i, p in enumerate(prompts):
        req = make_req(f"r{i}", p, slots[used:used + len(p)])
        used += len(p)
        entries.append(BatchEntry(req, 0, len(p), produces_token=True))
    logits = runner.run(Batch("prefill", entries))
    assert logits.shape == (3, 256)
    for row, p in zip(logits, prompts):
        torch.testing.assert_close(row, hf_last_logits(tiny_hf, p), atol=TOL, rtol=0)


def test_a_prompt_in_two_chunks_over_shuffled_slots_equals_one_full_pass(tiny_ours):
    """The second chunk attends to the first chunk's KV as a cached prefix (lower-right causal
    mask), with non-contiguous slot ids; decode steps after it stay equal too."""
    prompt = prompts_sharing_prefixes()[0]
    full = ModelRunner(tiny_ours, num_slots=64)
    req = make_req("a", prompt, np.arange(1, len(prompt) + 1))
    want = full.run(Batch("prefill", [BatchEntry(req, 0, len(prompt), True)]))

    chunked = ModelRunner(tiny_ours, num_slots=64)
    slots = np.random.default_rng(3).permutation(np.arange(1, 65))[:len(prompt)]
    req = make_req("b", prompt, slots)
    chunk = 17
    first = chunked.run(Batch("prefill", [BatchEntry(req, 0, chunk, False)]))
    got = chunked.run(Batch("prefill", [BatchEntry(req, chunk, len(prompt) - chunk, True)]))
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert not torch.allclose(first, want, atol=1e-3)  # the first chunk's last token is another


def test_mixed_prefix_lengths_in_one_batch_equal_separate_full_passes(tiny_hf, tiny_ours):
    """One step with a fresh prompt, a long cached prefix + short tail, and a one-token tail."""
    prompts = prompts_sharing_prefixes()[:3]
    contexts = [0, 35, len(prompts[2]) - 1]
    runner = ModelRunner(tiny_ours, num_slots=200)
    slots = np.random.default_rng(5).permutation(np.arange(1, 201))
    reqs, used = [], 0
    for i, p in enumerate(prompts):
        reqs.append(make_req(f"r{i}", p, slots[used:used + len(p)]))
        used += len(p)
    warm = [BatchEntry(r, 0, c, False) for r, c in zip(reqs, contexts) if c]
    runner.run(Batch("prefill", warm))  # the cached prefixes
    step = [BatchEntry(r, c, len(p) - c, True) for r, p, c in zip(reqs, prompts, contexts)]
    logits = runner.run(Batch("prefill", step))
    for row, p in zip(logits, prompts):
        torch.testing.assert_close(row, hf_last_logits(tiny_hf, p), atol=TOL, rtol=0)


# ---------------------------------------------------------------------------- generation vs HF
def engine(model, capacity: int, attention: str = "torch") -> EngineExecutor:
    """The engine on ``model``; Triton attention runs on a GPU when there is one (compiled)."""
    if attention.endswith("triton") and torch.cuda.is_available():
        model = copy.deepcopy(model).to("cuda")
    return EngineExecutor(ModelRunner(model, num_slots=capacity, attention=attention))


def needs_triton(attention: str) -> None:
    if attention == "triton" and not torch.cuda.is_available() \
            and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU; run with TRITON_INTERPRET=1 set before import to use the interpreter")


#: case -> (KV capacity, scheduler, output tokens, whether the last three arrive later)
PRESSURE = {
    "prefix_hits": (400, {"name": "lpm"}, 8, True),
    "eviction": (120, {"name": "lpm"}, 8, True),
    # admission reserves min(max_new, clip) = 1 output token per request, so it admits all six
    # and their decoding outgrows the pool: SGLang's retract_decode (with clip 4096, none)
    "retraction": (150, {"name": "lpm", "clip_max_new_tokens": 1}, 12, False),
}


@pytest.mark.parametrize("attention", ["torch", "triton", "cascade_torch", "cascade_triton"])
@pytest.mark.parametrize("case", PRESSURE)
def test_hits_eviction_and_retraction_each_keep_greedy_tokens_equal_to_hf(tiny_hf, tiny_ours, case,
                                                                          attention, monkeypatch):
    """Each pressure on its own: shared prefixes hit with nothing evicted or retracted; a tight
    pool evicts without retracting; an over-committing admission retracts (preemptions > 0).
    With cascade decoding, decode steps read the shared prefixes once (groups are formed)."""
    needs_triton(attention.removeprefix("cascade_"))
    from testbed.scheduler.decode_groups import DecodeGroups

    grouped = []
    find = DecodeGroups.__call__
    monkeypatch.setattr(DecodeGroups, "__call__",
                        lambda self, entries: grouped.append(find(self, entries)) or grouped[-1])
    capacity, scheduler, n, staggered = PRESSURE[case]
    prompts = prompts_sharing_prefixes()
    requests = [Request(f"r{i}", np.asarray(p, dtype=np.int32), np.zeros(n, dtype=np.int32),
                        arrival_s=100.0 if staggered and i >= 3 else 0.0)
                for i, p in enumerate(prompts)]
    cache = RadixCache(capacity)
    state, result = serve(requests, cache, scheduler, engine(tiny_ours, capacity, attention))
    for req, p in zip(result.reqs, (r.prompt.tolist() for r in requests)):
        assert not req.aborted and req.output == hf_greedy(tiny_hf, p, n), req.id
    hits = sum(r.cached_tokens or 0 for r in result.reqs)
    evicted = sum(r.evicted_tokens for r in result.reqs)
    assert hits >= 40
    if case == "prefix_hits":
        assert evicted == 0 and state.preemptions == 0
    elif case == "eviction":
        assert evicted > 0 and state.preemptions == 0
    else:
        assert state.preemptions > 0
        assert sum(r.preemptions for r in result.reqs) == state.preemptions
    assert any(grouped) == attention.startswith("cascade")
    cache.check_invariants()


@pytest.mark.parametrize("capacity, scheduler, cache_kind", [
    (400, {"name": "lpm"}, "radix"),                               # room for everything
    (90, {"name": "lpm"}, "radix"),                                # eviction and retraction
    (400, {"name": "fcfs", "chunked_prefill_size": 16}, "radix"),  # chunked prefill
    (400, {"name": "fcfs"}, "block_hash"),                         # vLLM-style 4-token blocks
    (90, {"name": "lpm"}, "radix_paged"),                          # whole pages of 4, evicted
    (400, {"name": "fcfs", "chunked_prefill_size": 7}, "radix_paged"),  # chunks end mid-page
])
def test_greedy_generation_through_the_scheduler_equals_hf_generate(tiny_hf, tiny_ours, capacity,
                                                                    scheduler, cache_kind):
    prompts = prompts_sharing_prefixes()
    n = 8
    requests = [Request(f"r{i}", np.asarray(p, dtype=np.int32), np.zeros(n, dtype=np.int32),
                        arrival_s=0.0 if i < 3 else 100.0) for i, p in enumerate(prompts)]
    cache = {"radix": lambda: RadixCache(capacity),
             "radix_paged": lambda: RadixCache(capacity, page_size=4),
             "block_hash": lambda: BlockHashCache(capacity, block_size=4)}[cache_kind]()
    scheduler_state, result = serve(requests, cache, scheduler, engine(tiny_ours, capacity))
    by_id = {r.id: r for r in result.reqs}
    for i, p in enumerate(prompts):
        req = by_id[f"r{i}"]
        assert not req.aborted
        assert req.output == hf_greedy(tiny_hf, p, n), f"request r{i}"
    assert sum(r.cached_tokens or 0 for r in result.reqs) >= 40  # prefixes were shared
    if capacity < 100:
        assert sum(r.evicted_tokens for r in result.reqs) + scheduler_state.preemptions > 0
    cache.check_invariants()


def test_a_second_turn_reuses_the_generated_first_turn_and_matches_hf(tiny_hf, tiny_ours):
    """Generating mode: turn 2's prompt splices in turn 1's actual output (the driver rebuilds
    it), hits it in the cache, and continues exactly as HF does on the same text."""
    rng = np.random.default_rng(7)
    p1, extra = rng.integers(0, 256, 20).astype(np.int32), rng.integers(0, 256, 6).astype(np.int32)
    n = 6
    turn1 = Request("t1", p1, np.zeros(n, dtype=np.int32), program="chat")
    turn2 = Request("t2", np.concatenate([p1, np.zeros(n, np.int32), extra]),
                    np.zeros(n, dtype=np.int32), program="chat", after=["t1"],
                    segments=(p1, OutputRef("t1"), extra))
    _, result = serve([turn1, turn2], RadixCache(300), {"name": "lpm"}, engine(tiny_ours, 300),
                      generate=True)
    r1, r2 = result.reqs
    want1 = hf_greedy(tiny_hf, p1.tolist(), n)
    assert r1.output == want1
    prompt2 = p1.tolist() + want1 + extra.tolist()
    assert r2.prompt.tolist() == prompt2
    assert r2.cached_tokens >= len(p1) + n - 1  # turn 1's prompt and (all but one) output hit
    assert r2.output == hf_greedy(tiny_hf, prompt2, n)


class FixedTime:
    """An executor's tokens with a fixed step time, so two runs' timelines coincide."""

    def __init__(self, tokens_of) -> None:
        self.tokens_of = tokens_of

    def execute(self, batch):
        return StepOutcome(duration_s=0.01, tokens=self.tokens_of(batch))


def test_forced_mode_returns_the_workloads_tokens_and_matches_the_simulators_decisions(tiny_ours):
    prompts = prompts_sharing_prefixes()
    rng = np.random.default_rng(2)
    requests = [Request(f"r{i}", np.asarray(p, dtype=np.int32),
                        rng.integers(0, 256, 5).astype(np.int32)) for i, p in enumerate(prompts)]
    forced = EngineExecutor(ModelRunner(tiny_ours, num_slots=120), forced=True)
    _, got = serve(requests, RadixCache(120), {"name": "lpm"},
                   FixedTime(lambda b: forced.execute(b).tokens), record_steps=True)
    _, want = serve(requests, RadixCache(120), {"name": "lpm"}, FixedTime(predetermined_tokens),
                    record_steps=True)
    assert got.steps == want.steps
    for a, b, r in zip(got.reqs, want.reqs, requests):
        assert a.output == b.output == r.output.tolist()
        assert a.cached_tokens == b.cached_tokens
    assert forced.forced_tokens == 5 * len(requests) and forced.busy_s > 0
    assert forced.steps == len(got.steps)


def test_a_step_is_timed_by_the_executors_clock_and_its_wall_time_kept_aside(tiny_ours):
    executor = EngineExecutor(ModelRunner(tiny_ours, num_slots=120), forced=True)
    # a clock of one's own: the step lasts what it says (launch 10.0 to 10.25, reading the
    # tokens back at 10.25 takes none)
    ticks = iter([10.0, 10.25, 10.25, 10.25])
    executor.clock = lambda: next(ticks)
    request = Request("r0", np.arange(1, 9, dtype=np.int32), np.array([3, 4], dtype=np.int32))
    req = Req(request=request, prompt=request.prompt, submitted_s=0.0, seq=0)
    req.lease = Lease(hit=0, slots=np.arange(1, 9, dtype=np.int32))
    outcome = executor.execute(Batch("prefill", [BatchEntry(req, 0, 8, produces_token=True)]))
    assert outcome.duration_s == executor.busy_s == 0.25
    assert outcome.gpu_s == 0.25 and outcome.host_s == 0.0  # the CPU: launch's work is the device's
    assert executor.wall_s > 0 and executor.steps == 1


# ---------------------------------------------------------------------------- checkpoints
def test_a_saved_checkpoint_loads_and_generates_like_the_in_memory_model(tmp_path, tiny_ours):
    hf = save_random_hf_model(tmp_path / "one", tiny_config(), seed=0)
    assert (tmp_path / "one" / "model.safetensors").is_file()
    loaded = load_model(tmp_path / "one")
    prompt = prompts_sharing_prefixes()[3]
    want = hf_last_logits(hf, prompt)
    for model in (loaded, ours_from(hf)):
        r = make_req("a", prompt, np.arange(1, len(prompt) + 1))
        got = ModelRunner(model, 100).run(Batch("prefill", [BatchEntry(r, 0, len(prompt), True)]))
        torch.testing.assert_close(got[0], want, atol=TOL, rtol=0)
    for a, b in zip(loaded.state_dict().values(), ours_from(hf).state_dict().values()):
        assert torch.equal(a, b)

    save_random_hf_model(tmp_path / "sharded", tiny_config(), seed=0, max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded = load_model(tmp_path / "sharded")
    for a, b in zip(sharded.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)


def test_tied_embeddings_load_without_an_lm_head_tensor(tmp_path):
    hf = save_random_hf_model(tmp_path, tiny_config(tie_word_embeddings=True), seed=4)
    model = load_model(tmp_path)
    assert model.lm_head is None
    prompt = list(range(30, 50))
    r = make_req("a", prompt, np.arange(1, 21))
    got = ModelRunner(model, 20).run(Batch("prefill", [BatchEntry(r, 0, 20, True)]))
    torch.testing.assert_close(got[0], hf_last_logits(hf, prompt), atol=TOL, rtol=0)


def test_a_missing_unexpected_or_misshapen_tensor_is_named(tmp_path, tiny_hf):
    state = dict(tiny_hf.state_dict())
    model = LlamaModel(ModelShape.from_hf(tiny_hf.config))
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_state_dict(model, missing)
    bad = state | {"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight'.*shape "
                                         r"\(64, 64\), expected \(32, 64\)"):
        load_state_dict(model, bad)
    extra = state | {"model.layers.2.self_attn.q_proj.weight": torch.zeros(64, 64)}
    with pytest.raises(BadInput, match=r"unexpected tensor 'model.layers.2.self_attn.q_proj.weight'"):
        load_state_dict(model, extra)
    # on disk: a checkpoint whose file lacks a tensor
    from safetensors.torch import save_file
    save_random_hf_model(tmp_path, tiny_config())
    save_file({k: v.contiguous() for k, v in missing.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'.*"
                                         + str(tmp_path.name)):
        load_model(tmp_path)
    with pytest.raises(BadInput, match="model.path: no config.json"):
        load_model(tmp_path / "nowhere")


def test_the_tiny_model_group_maps_to_a_llama_config_and_a_checkpoint_must_match_its_group(tmp_path):
    tiny = OmegaConf.to_container(OmegaConf.load(REPO / "conf/model/tiny.yaml"))
    config = config_from_model_group(tiny)
    c = ModelShape.from_hf(config)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.vocab_size) == (2, 64, 4, 2, 16, 128, 256)
    save_random_hf_model(tmp_path, config)
    check_model_group(tiny, config)
    llama = OmegaConf.to_container(OmegaConf.load(REPO / "conf/model/llama2_7b.yaml"))
    with pytest.raises(ValueError, match=r"model=llama2_7b does not match.*num_layers=32 but the "
                                         r"checkpoint has 2"):
        check_model_group(llama | {"path": str(tmp_path)}, config)
    ex = make_engine_executor(tiny | {"path": str(tmp_path)}, num_slots=50, device="cpu")
    assert ex.runner.model.dtype == torch.float32 and ex.runner.attention.name == "torch"
    assert ex.forced
    random_ex = make_engine_executor(tiny, num_slots=50, device="cpu", seed=3)
    again = build_model(config, seed=3)
    for a, b in zip(random_ex.runner.model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- other Llama-likes
def small_shape(**extra):
    return dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=200, max_position_embeddings=4096,
                tie_word_embeddings=False) | extra


VARIANTS = {
    "qwen2_bias": lambda: transformers.Qwen2Config(**small_shape()),
    "mistral": lambda: transformers.MistralConfig(**small_shape(sliding_window=None)),
    "llama_attention_and_mlp_bias": lambda: tiny_config(attention_bias=True, mlp_bias=True),
    "llama3_rope": lambda: tiny_config(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, rope_theta=500000.0),
    "linear_rope": lambda: tiny_config(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mha_head_dim_32": lambda: tiny_config(num_attention_heads=2, num_key_value_heads=2, head_dim=32),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_family_variants_match_their_hf_classes(variant):
    hf = hf_model(VARIANTS[variant](), seed=11)
    model = ours_from(hf)
    prompt = np.random.default_rng(0).integers(0, 200, 70).tolist()
    runner = ModelRunner(model, 100)
    r = make_req("a", prompt, np.random.default_rng(1).permutation(np.arange(1, 101))[:70])
    runner.run(Batch("prefill", [BatchEntry(r, 0, 50, False)]))
    got = runner.run(Batch("prefill", [BatchEntry(r, 50, 20, True)]))
    torch.testing.assert_close(got[0], hf_last_logits(hf, prompt), atol=TOL, rtol=0)


def test_unsupported_configs_are_refused_with_the_key():
    with pytest.raises(ValueError, match="rope_scaling type must be one of default, linear, llama3"):
        ModelShape.from_hf(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                      "original_max_position_embeddings": 64}))
    with pytest.raises(BadInput, match="model.path: config.json's hidden_act must be 'silu'"):
        ModelShape.from_hf(tiny_config(hidden_act="gelu"))


# ---------------------------------------------------------------------------- attention backends
def reference_kernels():
    try:
        from radix_kernels import reference
    except ImportError:
        pytest.skip("radix_kernels.reference (torch references of the kernels) not available")
    return reference


def random_step(seed=0, qo=(5, 1, 9), prefix=(0, 7, 12), heads=4, kv_heads=2, dim=16, slots=64):
    g = torch.Generator().manual_seed(seed)
    kv_lens = np.add(qo, prefix)
    idx = np.random.default_rng(seed).permutation(np.arange(1, slots + 1))[:kv_lens.sum()]
    meta = AttentionMetadata.build(np.array(qo), kv_lens, idx.astype(np.int32), "cpu")
    t = sum(qo)
    q = torch.randn(t, heads, dim, generator=g)
    k, v = torch.randn(t, kv_heads, dim, generator=g), torch.randn(t, kv_heads, dim, generator=g)
    bufs = [torch.randn(slots + 1, kv_heads, dim, generator=g) for _ in range(2)]
    return meta, q, k, v, bufs


@pytest.mark.parametrize("fused", [True, False], ids=["fused_cpu_decode", "matmul_decode"])
def test_torch_attention_equals_the_kernels_torch_reference(fused, monkeypatch):
    """Both decode paths of the torch backend: the CPU's fused kernel and the matmuls (CUDA's)."""
    if not fused:
        monkeypatch.setattr(attention_module, "FUSED_CPU_DECODE", None)
    else:
        assert attention_module.FUSED_CPU_DECODE is not None
    ref = reference_kernels()
    # the third step splits its long chunk behind a prefix into several query blocks
    for seed, qo, prefix in [(0, (5, 1, 9), (0, 7, 12)), (1, (1, 1, 1, 1), (3, 0, 20, 8)),
                             (2, (600, 3, 1, 300), (300, 0, 5, 0))]:
        meta, q, k, v, (kb, vb) = random_step(seed, qo, prefix, slots=2000)
        backend = TorchAttention(num_kv_heads=2)
        meta.plan = backend.plan(meta)
        ref.store_kv(kb, vb, meta.out_slots, k, v)  # the layer's RoPE-and-store step's part
        got = backend.forward(q, kb, vb, meta, 0.25)
        want = ref.extend_attention(q, kb, vb, meta.qo_indptr, meta.kv_indptr,
                                    meta.kv.indices(meta.table), 0.25)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_triton_backend_routes_to_its_layer_kernels_extend_and_decode(monkeypatch,
                                                                          tiny_ours):
    """With the kernels' torch references standing in for radix_kernels, the triton backend gives
    the torch backend's logits for prefill (extend) and decode steps."""
    ref = reference_kernels()
    calls = []

    def spy(name):
        def f(*args, max_new=None, num_kv_splits=None, **kwargs):  # launch settings: Triton's
            calls.append(name)
            return getattr(ref, name)(*args, **kwargs)
        return f

    fake = SimpleNamespace(**{n: spy(n) for n in ("extend_attention", "decode_attention",
                                                   "merge_states", "cascade_decode_attention",
                                                   "fused_add_rmsnorm", "silu_and_mul",
                                                   "rope_store_kv")})
    monkeypatch.setitem(sys.modules, "radix_kernels", fake)
    prompts = prompts_sharing_prefixes()[:2]
    outs = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(tiny_ours, 100, attention=backend)
        reqs = [make_req("a", prompts[0] + [1], np.arange(1, 51)),
                make_req("b", prompts[1] + [2], np.arange(51, 97))]
        pre = runner.run(Batch("prefill", [BatchEntry(r, 0, r.fill_len - 1, True) for r in reqs]))
        dec = runner.run(Batch("decode", [BatchEntry(r, r.fill_len - 1, 1, True) for r in reqs]))
        outs[backend] = (pre, dec)
    for a, b in zip(outs["torch"], outs["triton"]):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    assert set(calls) == {"extend_attention", "decode_attention", "fused_add_rmsnorm",
                          "silu_and_mul", "rope_store_kv"}


def test_the_real_triton_kernels_match_the_torch_backend(tiny_ours):
    try:
        import radix_kernels
    except ImportError:
        pytest.skip("radix_kernels is not importable")
    missing = [f for f in ("extend_attention", "decode_attention", "fused_add_rmsnorm",
                           "silu_and_mul", "rope_store_kv") if not hasattr(radix_kernels, f)]
    if missing:
        pytest.skip(f"radix_kernels does not provide {', '.join(missing)} yet")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU; run with TRITON_INTERPRET=1 set before import to use the interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = copy.deepcopy(tiny_ours).to(device)
    prompt = prompts_sharing_prefixes()[3]
    outs = []
    for backend in ("torch", "triton"):
        runner = ModelRunner(model, 100, attention=backend)
        r = make_req("a", prompt + [3], np.arange(1, len(prompt) + 2))
        a = runner.run(Batch("prefill", [BatchEntry(r, 0, 20, False)]))
        b = runner.run(Batch("prefill", [BatchEntry(r, 20, len(prompt) - 20, True)]))
        c = runner.run(Batch("decode", [BatchEntry(r, len(prompt), 1, True)]))
        outs.append((a, b, c))
    for x, y in zip(*outs):
        torch.testing.assert_close(x, y, atol=1e-3, rtol=0)


def test_the_runner_refuses_slots_beyond_its_kv_buffers(tiny_ours):
    runner = ModelRunner(tiny_ours, num_slots=8)
    r = make_req("a", list(range(10)), np.arange(1, 11))
    with pytest.raises(ValueError, match=r"KV slot ids must be in 1..8"):
        runner.run(Batch("prefill", [BatchEntry(r, 0, 10, True)]))
    assert KVCache.bytes_per_token(tiny_ours.config, torch.float32) == 2 * 2 * 2 * 16 * 4


# ---------------------------------------------------------------------------- sampler
def test_greedy_is_argmax_and_top_p_near_zero_is_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits), greedy)
    gen = torch.Generator().manual_seed(1)
    assert torch.equal(sample(logits, temperature=1.5, top_p=1e-9, generator=gen), greedy)
    mixed = sample(logits, temperature=torch.tensor([0.0, 1, 0, 1, 0, 1]), generator=gen)
    assert torch.equal(mixed[::2], greedy[::2])


def test_seeded_sampling_is_reproducible_and_top_p_keeps_to_the_nucleus():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    def draws(seed, top_p):
        sampler = Sampler(1.0, top_p, seed=seed)
        return torch.stack([sampler(logits) for _ in range(20)])

    assert torch.equal(draws(7, 0.9), draws(7, 0.9))
    assert torch.equal(draws(7, 1.0), draws(7, 1.0))
    assert not torch.equal(draws(7, 1.0), draws(8, 1.0))
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    s = Sampler(1.0, 0.6, seed=0)
    seen = {int(s(probs.log())) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.6, so the nucleus is the two most likely tokens
    with pytest.raises(ValueError, match="top_p must be in"):
        Sampler(1.0, 1.5)


def test_a_cpu_engine_fixes_glibcs_malloc_thresholds_once_per_process(monkeypatch):
    from testbed.engine import host_memory

    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(host_memory, "_done", False)
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: FakeLibc())
    monkeypatch.setattr(host_memory.sys, "platform", "linux")
    assert host_memory.keep_freed_memory() and host_memory.keep_freed_memory()
    assert calls == [(host_memory.M_MMAP_THRESHOLD, 32 << 20),
                     (host_memory.M_TRIM_THRESHOLD, 1 << 30)]
    monkeypatch.setattr(host_memory, "_done", False)
    monkeypatch.setattr(host_memory.sys, "platform", "darwin")
    assert not host_memory.keep_freed_memory() and len(calls) == 2


def test_a_chunk_behind_a_prefix_is_attended_in_query_blocks_that_stop_at_their_last_visible_key():
    assert TorchAttention.query_blocks(40, 40, "cpu") == [(0, 40, 40, None)]  # SDPA's own causal
    blocks = TorchAttention.query_blocks(600, 900, "cpu")
    assert [b[:3] for b in blocks] == [(0, 256, 556), (256, 512, 812), (512, 600, 900)]
    for start, end, keys, mask in blocks:
        assert mask.shape == (end - start, keys)
        visible = mask.sum(dim=1)  # query j (of the whole chunk) sees keys 0 .. 300 + j
        assert visible.tolist() == [300 + j + 1 for j in range(start, end)]


# ---------------------------------------------------------------------------- SGLang's schedule
def engine_burst(tiny_ours, **scheduler):
    """8 requests sharing a 64-token prefix, arriving together, 4 greedy tokens each."""
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, 256, 64).astype(np.int32)
    requests = [Request(f"b{i}", np.concatenate([prefix, rng.integers(0, 256, n).astype(np.int32)]),
                        np.zeros(4, dtype=np.int32)) for i, n in enumerate(range(4, 12))]
    cfg = {"name": "lpm", "chunked_prefill_size": 500, **scheduler}
    _, result = serve(requests, RadixCache(2000), cfg, engine(tiny_ours, 2000), record_steps=True)
    return requests, result


def test_the_engine_runs_the_burst_as_sglang_and_each_request_equals_hf(tiny_hf, tiny_ours):
    requests, result = engine_burst(tiny_ours)
    prefills = [s for s in result.steps if s.kind == "prefill"]
    # sorted with the deprioritized last, 7 whole requests (68..74 tokens, 497) and 3 tokens of b7
    assert [s.new for s in prefills] == [(68, 69, 70, 71, 72, 73, 74, 3), (72,)]
    assert [r.cached_tokens for r in result.reqs] == [0] * 8
    for req, r in zip(result.reqs, requests):
        assert req.output == hf_greedy(tiny_hf, r.prompt.tolist(), 4)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_with_in_batch_hold_computes_the_prefix_once_and_equals_hf(tiny_hf, tiny_ours,
                                                                              overlap):
    requests, result = engine_burst(tiny_ours, in_batch_hold=True, overlap=overlap)
    prefills = [s for s in result.steps if s.kind == "prefill"]
    # with overlap, b0's prompt reaches the tree only after the second batch has formed: b1,
    # first of the held, runs alone then without a hit
    cold = 2 if overlap else 1
    assert [s.ids for s in prefills[:cold]] == [("b0",), ("b1",)][:cold]
    assert len(prefills) == cold + 1 and set(prefills[-1].context) == {64}
    assert sorted(r.cached_tokens for r in result.reqs) == [0] * cold + [64] * (8 - cold)
    assert sum(sum(s.new) for s in prefills) == 64 * cold + sum(range(4, 12))
    for req, r in zip(result.reqs, requests):
        assert req.output == hf_greedy(tiny_hf, r.prompt.tolist(), 4)
