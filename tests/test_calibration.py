"""Calibration and the simulator-vs-engine decision check (tiny model, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from testbed.config.assembly import assemble, compose_config
from testbed.calibrate import (calibrate, floor_check, grid, grid_slots, row_knots,
                               slot_layout, slot_order, synthetic_batch, timed_pass)
from testbed.errors import BadInput
from testbed.engine import make_engine_executor
from testbed.sim.cost_model import (FittedCostModel, RooflineCostModel, StepShape, load_fitted,
                                   row_weights, save_fitted)
from testbed.sim.specs import HardwareSpec
from testbed.sim.executor import SimExecutor
from testbed.sim.fit import fit_coefficients, nnls
from testbed.serving.serve import serve

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(name: str = "config", *overrides: str):
    return compose_config(["model=tiny", "hardware=cpu", "progress=false", *overrides], name)


def test_nnls_recovers_non_negative_coefficients_and_clips_negative_ones():
    rng = np.random.default_rng(0)
    a = rng.random((40, 5))
    assert np.allclose(nnls(a, a @ np.array([1.0, 0.0, 2.0, 0.0, 0.5])), [1, 0, 2, 0, 0.5])
    assert (nnls(a, a @ np.array([1.0, -3.0, 2.0, 0.0, 0.5])) >= 0).all()


def test_fit_recovers_a_known_step_time_law_per_kind():
    # Decode steps have new == 1, so Σnew and batch (and Σ new·context and Σcontext) coincide:
    # coefficients are not unique there, predictions are. Compare predictions on unseen shapes.
    law = {"prefill": (1e-3, 2e-5, 1e-8, 0.0, 3e-7), "decode": (5e-4, 0.0, 0.0, 1e-5, 2e-8)}

    def true_time(step: StepShape) -> float:
        a, b, c, d, e = law[step.kind]
        return (a + b * step.num_new + c * step.attended_pairs + d * step.batch
                + e * step.num_context)

    shapes = [StepShape((new,) * batch, (ctx,) * batch) for batch in (1, 2, 8)
              for new in (16, 64, 200) for ctx in (0, 100, 1000)]
    shapes += [StepShape.decode((ctx + 1,) * batch) for batch in (1, 2, 8) for ctx in (0, 100, 1000)]
    coeffs = fit_coefficients([(s, true_time(s)) for s in shapes])
    for step in (StepShape((50, 7), (300, 20)), StepShape.decode((77, 512, 4))):
        a, b, c, d, e = (coeffs[step.kind][k] for k in "abcde")
        predicted = (a + b * step.num_new + c * step.attended_pairs + d * step.batch
                     + e * step.num_context)
        assert predicted == pytest.approx(true_time(step), rel=1e-6)


def test_fit_tells_a_padded_decode_from_an_unpadded_one_on_ragged_batches():
    # decode time 1e-3 + 2e-6·Σcontext + 5e-6·batch·max(context): on uniform batches the last two
    # coincide; ragged ones (contexts spread evenly) separate them, and the fit finds both
    def true_time(step: StepShape) -> float:
        return 1e-3 + 2e-6 * step.num_context + 5e-6 * step.batch * max(step.context) \
            if step.is_decode else 1e-3 + 1e-5 * step.num_new

    cfg = {"prefill_batch": [1, 2], "prefill_new": [16, 64], "prefill_context": [0, 100],
           "decode_batch": [1, 4, 8], "decode_context": [16, 256, 1024], "decode_ragged": True}
    coeffs = fit_coefficients([(s, true_time(s)) for s in grid(cfg)])
    assert coeffs["decode"]["e"] == pytest.approx(2e-6, rel=1e-4)
    assert coeffs["decode"]["f"] == pytest.approx(5e-6, rel=1e-4)
    assert coeffs["prefill"]["f"] == 0.0


def test_row_weights_read_between_the_measured_row_counts_and_per_row_beyond_them():
    knots = [2, 4, 8]
    assert row_weights(knots, 1) == [1.0, 0.0, 0.0]  # below the least: its cost
    assert row_weights(knots, 2) == [1.0, 0.0, 0.0]
    assert row_weights(knots, 3) == [0.5, 0.5, 0.0]
    assert row_weights(knots, 7) == [0.0, 0.25, 0.75]
    assert row_weights(knots, 8) == [0.0, 0.0, 1.0]
    assert row_weights(knots, 12) == [0.0, 0.0, 1.5]  # the largest's cost per row
    assert row_weights([4], 2) == [1.0] and row_weights([4], 6) == [1.5]


def test_a_row_table_fits_a_decode_cost_that_jumps_with_the_batch_exactly():
    # a BLAS that switches code path at 4 rows: 50, 53, 57 ms for 1-3 requests, then 87, 117 and
    # 129 ms; no a + d·batch + g·few_row_passes follows it, the table does, to the measured sizes
    jump = {1: 0.050, 2: 0.053, 3: 0.057, 4: 0.087, 8: 0.117, 16: 0.129}

    def true_time(step: StepShape) -> float:
        return jump[step.batch] + 2e-6 * step.num_context if step.is_decode \
            else 1e-3 + 1e-5 * step.num_new

    cfg = {"prefill_batch": [1, 2], "prefill_new": [16, 64], "prefill_context": [0, 100],
           "decode_batch": list(jump), "decode_context": [16, 256, 1024],
           "decode_batch_fill": False}  # the sizes between are read off the table below
    samples = [(s, true_time(s)) for s in grid(cfg)]
    coeffs = fit_coefficients(samples, row_knots=row_knots(cfg, grid(cfg)))
    assert {k: round(v, 9) for k, v in coeffs["decode"].items() if k.startswith("n")} == {
        f"n{k}": v for k, v in jump.items()}
    assert [coeffs["decode"][k] for k in "abcdg"] == [0.0] * 5
    assert coeffs["decode"]["e"] + coeffs["decode"]["f"] == pytest.approx(2e-6)
    # the prefills (1 or 2 requests of 16 or 64 tokens: 16, 32, 64 and 128 rows) get a table of
    # their own, a and b held at 0, which prices each of them as measured
    assert sorted(k for k in coeffs["prefill"] if k.startswith("n")) == ["n128", "n16", "n32",
                                                                          "n64"]
    assert (coeffs["prefill"]["a"], coeffs["prefill"]["b"]) == (0.0, 0.0)
    floor = RooflineCostModel(assemble(config()).model_shape,
                              HardwareSpec("fast", flops=1e18, mem_bw=1e18, memory_bytes=10**10))
    fitted = FittedCostModel(coeffs, floor)
    six = StepShape.decode((100,) * 6)  # halfway between 4 and 8
    assert fitted.step_time(six) == pytest.approx(0.102 + 2e-6 * 600, rel=1e-6)
    assert all(fitted.step_time(s) == pytest.approx(t, rel=1e-6) for s, t in samples)
    linear = FittedCostModel(fit_coefficients(samples), floor)
    errors = [abs(linear.step_time(s) / t - 1) for s, t in samples if s.is_decode]
    assert max(errors) > 0.1  # the line misses the jump by over 10% somewhere
    assert row_knots(cfg | {"row_table": False}, grid(cfg)) == {}
    with pytest.raises(BadInput, match="row_table must be true or false"):
        row_knots(cfg | {"row_table": "yes"}, grid(cfg))


def test_a_row_table_follows_a_prefill_that_costs_more_a_token_as_its_rows_grow():
    # 1.3 ms a token up to 1,024 rows, then 5.5 s at 4,096 (the development machine's 16 x 256):
    # the table reads 2,682 rows (few-shot's 16 prompts) between the two, which a + b·rows cannot
    per_rows = {16: 0.0208, 64: 0.0832, 256: 0.3328, 1024: 1.3312, 4096: 5.5}

    def true_time(step: StepShape) -> float:
        return per_rows[step.num_new] if not step.is_decode else 0.05 + 2e-6 * step.num_context

    cfg = {"prefill_batch": [1, 4, 16], "prefill_new": [16, 64, 256], "prefill_context": [0],
           "decode_batch": [1, 4], "decode_context": [16, 256]}
    steps = grid(cfg)  # prefills of 16, 64, 256, 1,024 and 4,096 rows
    coeffs = fit_coefficients([(s, true_time(s)) for s in steps], row_knots=row_knots(cfg, steps))
    floor = RooflineCostModel(assemble(config()).model_shape,
                              HardwareSpec("fast", flops=1e18, mem_bw=1e18, memory_bytes=10**10))
    few_shot = StepShape((168,) * 15 + (162,), (0,) * 16)  # 2,682 rows
    t = (2682 - 1024) / (4096 - 1024)
    assert FittedCostModel(coeffs, floor).step_time(few_shot) == pytest.approx(
        (1 - t) * 1.3312 + t * 5.5, rel=1e-6)


def test_a_fitted_file_keeps_its_batch_table_and_rejects_bad_entries(tmp_path):
    floor = RooflineCostModel(assemble(config()).model_shape, assemble(config()).hardware)
    row = dict.fromkeys("abcdefg", 0.0)
    coeffs = {"decode": row | {"e": 1e-6, "n1": 0.05, "n4": 0.08}, "prefill": row | {"a": 0.01}}
    save_fitted(tmp_path / "c.yaml", coeffs, {"model": "tiny", "device": "cpu"})
    loaded = load_fitted(tmp_path / "c.yaml", floor)
    assert loaded.coeffs == {kind: row | {"h": row["e"]} for kind, row in coeffs.items()}
    assert loaded.predict(StepShape.decode((10, 10))) == pytest.approx(
        0.05 + (0.08 - 0.05) / 3 + 2e-5)
    bad = tmp_path / "bad.yaml"
    bad.write_text((tmp_path / "c.yaml").read_text().replace("n4: 0.08", "n4: -1"))
    with pytest.raises(BadInput, match=r"coeffs.decode.n4 must be a number >= 0, got -1"):
        load_fitted(bad, floor)
    bad.write_text((tmp_path / "c.yaml").read_text().replace("n4: 0.08", "m4: 0.08"))
    with pytest.raises(BadInput, match=r"unknown coeffs.decode keys \['m4'\].*n<K>"):
        load_fitted(bad, floor)


def test_the_grid_fills_every_decode_batch_size_between_the_listed_ones_at_the_least_context():
    """Each row count is priced on its own (row_table): none is read between two measured."""
    cfg = config("calibrate", "calibrate.decode_batch=[1,4,6]", "calibrate.decode_context=[64,512]",
                 "calibrate.decode_ragged=false", "calibrate.decode_shared=false").calibrate
    decodes = [s.context for s in grid(cfg) if s.is_decode]
    assert decodes[6:] == [(64,) * 2, (64,) * 3, (64,) * 5]
    off = config("calibrate", "calibrate.decode_batch=[1,4]", "calibrate.decode_batch_fill=false",
                 "calibrate.decode_ragged=false", "calibrate.decode_shared=false").calibrate
    assert sorted({s.batch for s in grid(off) if s.is_decode}) == [1, 4]
    linear = config("calibrate", "calibrate.decode_batch=[1,4]", "calibrate.row_table=false",
                    "calibrate.decode_ragged=false", "calibrate.decode_shared=false").calibrate
    assert sorted({s.batch for s in grid(linear) if s.is_decode}) == [1, 4]


def test_the_ragged_grid_spreads_contexts_from_the_least_to_each_larger_one():
    cfg = {"prefill_batch": [1], "prefill_new": [16], "prefill_context": [0],
           "decode_batch": [1, 3], "decode_context": [10, 50, 90], "decode_batch_fill": False}
    uniform = grid(cfg)
    assert [s.context for s in uniform if s.is_decode] == \
        [(10,), (50,), (90,), (10,) * 3, (50,) * 3, (90,) * 3]
    ragged = grid(cfg | {"decode_ragged": True})
    assert ragged[:len(uniform)] == uniform
    assert [s.context for s in ragged[len(uniform):]] == [(10, 30, 50), (10, 50, 90)]
    assert all(s.is_decode for s in ragged[len(uniform):])
    with pytest.raises(BadInput, match="decode_ragged must be true or false"):
        grid(cfg | {"decode_ragged": "yes"})


def test_synthetic_batches_have_the_requested_shape_and_distinct_slots():
    step = StepShape(new=(5, 1, 3), context=(0, 9, 4))
    batch = synthetic_batch(step, vocab=256, rng=np.random.default_rng(0))
    assert batch.shape() == (step.new, step.context)
    slots = np.concatenate([e.kv_slots() for e in batch.entries])
    assert len(set(slots.tolist())) == len(slots) == 5 + 10 + 7


def test_interleaved_slots_alternate_the_contexts_across_requests_then_give_each_its_new_tokens():
    step = StepShape(new=(2, 1, 1), context=(3, 1, 2))
    slots = [s.tolist() for s in slot_order(step, "interleaved")]
    # token 0 of requests 0,1,2 -> 1,2,3; token 1 of requests 0,2 -> 4,5; token 2 of request 0 -> 6
    assert slots == [[1, 4, 6, 7, 8], [2, 9], [3, 5, 10]]


def test_runs_alternate_the_contexts_across_requests_32_tokens_at_a_time():
    step = StepShape(new=(1, 1), context=(40, 70))
    a, b = (s.tolist() for s in slot_order(step, "runs"))
    # tokens 0-31 of request 0, then of request 1, then 32-39 of 0 and 32-63 of 1, then 64-69 of 1
    assert a == list(range(1, 33)) + list(range(65, 73)) + [111]
    assert b == list(range(33, 65)) + list(range(73, 105)) + list(range(105, 111)) + [112]


def test_contiguous_slots_give_each_request_one_run():
    step = StepShape(new=(2, 1, 1), context=(3, 1, 2))
    assert [s.tolist() for s in slot_order(step, "contiguous")] == \
        [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]


def test_a_lone_request_is_contiguous_in_either_layout():
    step = StepShape.decode((5,))
    assert slot_order(step, "interleaved")[0].tolist() == list(range(1, 7))


def test_synthetic_batches_take_the_layout_they_are_given():
    step = StepShape.decode((2, 2))
    batch = synthetic_batch(step, 256, np.random.default_rng(0), "interleaved")
    assert [e.kv_slots().tolist() for e in batch.entries] == [[1, 3, 5], [2, 4, 6]]


def test_a_shared_decode_batch_begins_every_request_with_the_same_prefix_slots():
    step = StepShape.decode((5, 5, 5), reread=2 * 3)  # a prefix of 3 shared by 3 requests
    assert [s.tolist() for s in slot_order(step, "interleaved")] == \
        [[1, 2, 3, 4, 7, 10], [1, 2, 3, 5, 8, 11], [1, 2, 3, 6, 9, 12]]
    assert [s.tolist() for s in slot_order(step, "contiguous")] == \
        [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9], [1, 2, 3, 10, 11, 12]]


def test_the_shared_grid_shares_all_but_the_least_context_in_each_batch_of_two_or_more():
    cfg = {"prefill_batch": [1], "prefill_new": [16], "prefill_context": [0],
           "decode_batch": [1, 3], "decode_context": [10, 50]}
    assert [(s.context, s.reread) for s in grid(cfg | {"decode_shared": True})
            if s.reread] == [((50, 50, 50), 2 * 40)]
    assert not any(s.reread for s in grid(cfg))  # off unless asked
    with pytest.raises(BadInput, match="decode_shared must be true or false"):
        grid(cfg | {"decode_shared": "yes"})


def test_the_shared_grid_takes_its_own_contexts_when_given_and_refuses_one_at_the_least():
    cfg = {"prefill_batch": [1], "prefill_new": [16], "prefill_context": [0],
           "decode_batch": [1, 3], "decode_context": [10, 50, 90], "decode_shared": True}
    assert [(s.context, s.reread) for s in grid(cfg) if s.reread] == \
        [((50, 50, 50), 2 * 40), ((90, 90, 90), 2 * 80)]
    assert [(s.context, s.reread) for s in grid(cfg | {"decode_shared_context": [30]})
            if s.reread] == [((30, 30, 30), 2 * 20)]
    with pytest.raises(BadInput, match=r"decode_shared_context must be null or a non-empty list "
                                       r"of integers > the least decode_context \(10\)"):
        grid(cfg | {"decode_shared_context": [10]})


def test_the_fit_prices_re_read_kv_apart_when_the_grid_measured_it():
    # re-read KV at 1e-6 s a token, first reads at 4e-6: a CPU's caches hold the shared prefix
    def true_time(step: StepShape) -> float:
        if not step.is_decode:
            return 1e-3 + 1e-5 * step.num_new
        return 0.05 + 4e-6 * (step.num_context - step.reread) + 1e-6 * step.reread

    # ragged batches tell e from the padded term f, shared ones h from both
    cfg = {"prefill_batch": [1, 2], "prefill_new": [16, 64], "prefill_context": [0, 100],
           "decode_batch": [1, 4, 8], "decode_context": [16, 256, 1024], "decode_ragged": True}
    shared = grid(cfg | {"decode_shared": True})
    coeffs = fit_coefficients([(s, true_time(s)) for s in shared],
                              row_knots=row_knots(cfg, shared))
    assert coeffs["decode"]["e"] == pytest.approx(4e-6, rel=1e-6)
    assert coeffs["decode"]["h"] == pytest.approx(1e-6, rel=1e-6)
    assert coeffs["decode"]["f"] == pytest.approx(0.0, abs=1e-12)
    assert coeffs["prefill"]["h"] == coeffs["prefill"]["e"]  # none measured: a first read's
    unshared = fit_coefficients([(s, true_time(s)) for s in grid(cfg)])
    assert unshared["decode"]["h"] == unshared["decode"]["e"]
    floor = RooflineCostModel(assemble(config()).model_shape,
                              HardwareSpec("fast", flops=1e18, mem_bw=1e18, memory_bytes=10**10))
    assert FittedCostModel(coeffs, floor).prices_rereads
    assert not FittedCostModel(unshared, floor).prices_rereads


def test_a_fitted_file_without_h_prices_re_reads_as_first_reads_to_the_bit(tmp_path):
    floor = RooflineCostModel(assemble(config()).model_shape, assemble(config()).hardware)
    row = {"a": 0.01, "b": 0.0, "c": 1e-9, "d": 1e-3, "e": 3e-6}  # a file from before f, g, h
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"coeffs": {"decode": row, "prefill": row}}))
    old = load_fitted(path, floor)
    assert old.coeffs["decode"]["h"] == 3e-6 and not old.prices_rereads
    step = StepShape.decode((300, 300, 40))
    assert old.predict(StepShape.decode((300, 300, 40), reread=200)) == old.predict(step) == \
        0.01 + 1e-9 * step.attended_pairs + 3e-3 + 3e-6 * 640


def test_the_simulator_prices_a_decode_steps_re_read_prefix_at_h(tmp_path):
    """few-shot's questions decode together under their shared examples: with h = 0 each decode
    step is shorter by e x the KV its requests read again, which the step records say exactly."""
    def run_with(h: float | None):
        row = {"a": 0.01, "b": 1e-5, "c": 0.0, "d": 1e-3, "e": 2e-5, "f": 0.0, "g": 0.0}
        decode = row | ({} if h is None else {"h": h})
        path = tmp_path / f"h{h}.yaml"
        path.write_text(yaml.safe_dump({"coeffs": {"decode": decode, "prefill": row}}))
        cfg = config("config", "workload=few_shot", "workload.num_tasks=1",
                     "workload.questions_per_task=4", "workload.vocab_size=256",
                     "workload.example_len=20", "workload.question_len=9",
                     "workload.output_len=6", "cost_model=fitted", f"cost_model.path={path}")
        run = assemble(cfg)
        requests = run.requests()
        _, result = serve(requests, run.build_cache(300, requests), {"name": "lpm"},
                          SimExecutor(run.build_cost_model()), record_steps=True)
        return result, [r.prompt for r in requests]

    (plain, _), (cheap, prompts) = run_with(None), run_with(0.0)
    shared = min(len(p) for p in prompts)
    while any((p[:shared] != prompts[0][:shared]).any() for p in prompts):
        shared -= 1
    assert [(s.ids, s.reread) for s in plain.steps] == [(s.ids, s.reread) for s in cheap.steps]
    full = [s for s in cheap.steps if s.kind == "decode" and len(s.ids) == 4]
    assert full and all(s.reread == 3 * shared for s in full)
    for a, b in zip(plain.steps, cheap.steps):
        assert a.duration_s - b.duration_s == pytest.approx(2e-5 * a.reread, abs=1e-12)


def test_slot_layout_defaults_to_runs_and_names_the_choices_on_a_bad_value():
    assert slot_layout({}) == "runs"
    assert slot_layout({"slot_layout": "contiguous"}) == "contiguous"
    with pytest.raises(BadInput, match="calibrate.slot_layout must be one of runs, interleaved, "
                                       "contiguous; got 'random'"):
        slot_layout({"slot_layout": "random"})


class RecordingExecutor:
    """Stands in for the engine: a batch's step time is its first request's number."""

    def __init__(self):
        self.order = []

    def execute(self, batch):
        index = int(batch.entries[0].req.id.removeprefix("cal"))
        self.order.append(index)
        return SimpleNamespace(duration_s=float(index))


def test_a_timed_pass_runs_each_batch_once_in_random_order_and_returns_times_in_batch_order():
    rng = np.random.default_rng(0)
    batches = [synthetic_batch(StepShape.decode((4,) * (i + 1)), 256, rng) for i in range(6)]
    for b, i in zip(batches, range(6)):  # name each batch's first request by its position
        b.entries[0].req.request.id = f"cal{i}"
    executor = RecordingExecutor()
    first = timed_pass(executor, batches, rng)
    second = timed_pass(executor, batches, rng)
    assert first == second == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert sorted(executor.order[:6]) == sorted(executor.order[6:]) == list(range(6))
    assert executor.order[:6] != executor.order[6:]  # each pass has its own order


def test_grid_slots_is_the_largest_batchs_tokens():
    steps = [StepShape((16, 16), (0, 256)), StepShape.decode((2048,) * 4)]
    assert grid_slots(steps) == 4 * 2049 and grid_slots([]) == 0


def test_calibration_writes_a_usable_cost_model_and_its_report(tmp_path):
    cfg = config("calibrate", "calibrate.repeats=1", "calibrate.prefill_batch=[1,2]",
                 "calibrate.prefill_new=[8,32]", "calibrate.prefill_context=[0,16]",
                 "calibrate.decode_batch=[1,4]", "calibrate.decode_context=[8,64]",
                 "calibrate.decode_ragged=false")
    result = calibrate(cfg, tmp_path)
    run = assemble(cfg)
    floor = RooflineCostModel(run.model_shape, run.hardware)
    fitted = load_fitted(tmp_path / "cost_model.yaml", floor_model=floor)
    for sample in result["samples"]:
        step = StepShape(tuple(sample["new"]), tuple(sample["context"]),
                         reread=sample["reread"], verify=sample.get("verify", False))
        assert fitted.step_time(step) >= floor.floor(step)
    saved = json.loads((tmp_path / "calibration.json").read_text())
    # 8 prefills, 4 decodes, 1 shared decode (4 requests sharing 56 of their 64 tokens), the
    # batches of 2 and 3 between 1 and 4 at the least context (calibrate.decode_batch_fill), and
    # conf/calibrate.yaml's verifications: 5 query counts x 3 batch sizes x 2 decode contexts
    assert set(saved["mape"]) == {"prefill", "decode", "verify"}
    assert len(saved["samples"]) == 15 + 30
    assert sorted({sum(x["new"]) for x in saved["samples"] if x["kind"] == "verify"}) == \
        [2, 3, 4, 5, 6, 8, 9, 10, 12, 16, 18, 20, 36]
    assert set(fitted.coeffs) == {"decode", "prefill", "verify"}
    assert {f"n{k}" for k in (2, 3, 5, 9, 36)} <= set(fitted.coeffs["verify"])
    assert [x["reread"] for x in saved["samples"]].count(3 * 56) == 1
    assert (tmp_path / "calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_floor_check_counts_the_steps_measured_faster_than_the_roofline_and_warns(capsys):
    """A preset whose peak is below what the machine does is no floor: say so, and how far."""
    shape = assemble(config()).model_shape
    slow = RooflineCostModel(shape, HardwareSpec("slow", flops=1e9, mem_bw=1e9,
                                                 memory_bytes=10**10))
    steps = [StepShape((64,), (0,)), StepShape.decode((32,)), StepShape.decode((32, 32))]
    floors = [slow.floor(s) for s in steps]
    samples = [(steps[0], floors[0] / 2), (steps[1], floors[1] * 3), (steps[2], floors[2] / 4)]
    assert floor_check(samples, slow) == {"steps_below_floor": 2}
    err = capsys.readouterr().err
    assert "hardware=slow is above 2 of 3 measured steps (by up to 4.00x)" in err
    assert "hardware.flops and hardware.mem_bw" in err
    assert floor_check([(s, f * 1.01) for s, f in zip(steps, floors)], slow) == {
        "steps_below_floor": 0}
    assert capsys.readouterr().err == ""


def test_the_cpu_presets_floor_is_below_smollm2_steps_measured_on_this_projects_machine():
    """hardware=cpu's peaks bound real steps: SmolLM2 at one thread on the 2026-12-04 machine
    (AVX-512) ran 1,024-token prefills at 200 GFLOP/s, twice the old 100 GFLOP/s preset, whose
    floor then lifted the fit's predictions 50% above the measured prefills."""
    run = assemble(compose_config(["model=smollm2_135m", "hardware=cpu"], "config"))
    floor = RooflineCostModel(run.model_shape, run.hardware)
    measured = [(StepShape((256,) * 4, (0,) * 4), 1.386), (StepShape((256,), (0,)), 0.3736),
                (StepShape((16,) * 4, (1024,) * 4), 0.2349), (StepShape.decode((64,)), 0.0484),
                (StepShape.decode((1536,) * 16), 0.398)]
    assert floor_check(measured, floor) == {"steps_below_floor": 0}
    old = RooflineCostModel(run.model_shape, HardwareSpec("old", flops=100e9, mem_bw=20e9,
                                                          memory_bytes=24 * 10**9))
    assert floor_check(measured, old)["steps_below_floor"] >= 2


def test_offline_batch_makes_identical_decisions_on_the_engine_and_the_simulator():
    cfg = config("config", "workload=few_shot", "workload.num_tasks=3", "workload.questions_per_task=4",
                 "workload.vocab_size=256", "workload.example_len=20", "workload.question_len=9")
    run = assemble(cfg)
    requests = run.requests()
    runs = []
    for executor in (make_engine_executor(run.config["model"], num_slots=300, forced=True),
                     SimExecutor(RooflineCostModel(run.model_shape, run.hardware))):
        _, result = serve(requests, run.build_cache(300, requests), {"name": "lpm"}, executor,
                          record_steps=True)
        runs.append(result)
    engine, sim = runs
    assert [(s.kind, s.ids, s.new, s.context) for s in engine.steps] == \
        [(s.kind, s.ids, s.new, s.context) for s in sim.steps]
    assert [r.cached_tokens for r in engine.reqs] == [r.cached_tokens for r in sim.reqs]
    assert sum(r.cached_tokens for r in sim.reqs) > 0


# ------------------------------------------------------------------ speculative verification steps
VERIFY_GRID = {"prefill_batch": [1, 2], "prefill_new": [16, 64], "prefill_context": [0, 100],
               "decode_batch": [1, 2, 4], "decode_context": [64, 512], "decode_batch_fill": False,
               "verify_new": [2, 3, 5, 9], "verify_batch": [1, 2]}


def test_the_grid_measures_verifications_of_each_query_count_batch_and_decode_context():
    steps = [s for s in grid(VERIFY_GRID) if s.verify]
    assert [(s.new, s.context) for s in steps] == [
        ((q,) * b, (c,) * b) for b in (1, 2) for q in (2, 3, 5, 9) for c in (64, 512)]
    assert {s.kind for s in steps} == {"verify"}
    assert row_knots(VERIFY_GRID, grid(VERIFY_GRID))["verify"] == [2, 3, 4, 5, 6, 9, 10, 18]
    for off in (None, []):  # a config from before the key, or none asked for
        assert not any(s.verify for s in grid(VERIFY_GRID | {"verify_new": off}))
    with pytest.raises(BadInput, match=r"calibrate.verify_new must be null or a list of "
                                       r"integers >= 2 .*got \[1, 3\]"):
        grid(VERIFY_GRID | {"verify_new": [1, 3]})
    with pytest.raises(BadInput, match=r"calibrate.verify_batch must be a non-empty list"):
        grid({k: v for k, v in VERIFY_GRID.items() if k != "verify_batch"})


def test_a_verification_batch_is_a_decode_batch_whose_requests_carry_drafts_after_their_last_token():
    step = StepShape.verification((5, 3), (64, 10))
    batch = synthetic_batch(step, vocab=256, rng=np.random.default_rng(0))
    assert batch.kind == "decode" and batch.verifies
    assert batch.shape() == (step.new, step.context)
    assert [len(e.draft) for e in batch.entries] == [4, 2]
    assert [len(e.input_ids()) for e in batch.entries] == [5, 3]
    assert all(e.makes_output and e.output_index == 0 for e in batch.entries)
    slots = np.concatenate([e.kv_slots() for e in batch.entries])
    assert len(set(slots.tolist())) == len(slots) == 69 + 13


def test_a_fit_prices_a_verification_step_from_its_own_knots_exactly():
    """Verifications cost a row table of their own (every query's logits: here 40 ms at 2 rows,
    44 at 3, 60 at 5, 75 at 9) plus their attention; prefills of the same rows cost otherwise.
    The fit prices every measured step as measured, reads a verification between two measured
    query counts linearly, and a prefill of as many rows by the prefill's table."""
    table = {2: 0.040, 3: 0.044, 5: 0.060, 9: 0.075}
    cfg = VERIFY_GRID | {"verify_batch": [1]}

    def true_time(step: StepShape) -> float:
        if step.kind == "verify":
            return table[step.num_new] + 2e-6 * step.num_context + 1e-8 * step.attended_pairs
        if step.is_decode:
            return 0.030 + 1e-5 * step.batch + 2e-6 * step.num_context
        return 0.010 + 1e-3 * step.num_new + 1e-7 * step.num_context

    samples = [(s, true_time(s)) for s in grid(cfg)]
    coeffs = fit_coefficients(samples, row_knots=row_knots(cfg, grid(cfg)))
    v = coeffs["verify"]  # one batch size: its per-request d is each knot's to share
    assert {k: round(v[f"n{k}"] + v["d"], 9) for k in table} == table
    assert (v["a"], v["b"]) == (0.0, 0.0)
    floor = RooflineCostModel(assemble(config()).model_shape,
                              HardwareSpec("fast", flops=1e18, mem_bw=1e18, memory_bytes=10**10))
    fitted = FittedCostModel(coeffs, floor)
    assert all(fitted.step_time(s) == pytest.approx(t, rel=1e-6) for s, t in samples)
    for q, cost in ((4, (0.044 + 0.060) / 2), (7, (0.060 + 0.075) / 2)):  # between two knots
        step = StepShape.verification((q,), (300,))  # at a context the grid did not measure
        assert fitted.step_time(step) == pytest.approx(
            cost + 2e-6 * 300 + 1e-8 * step.attended_pairs, rel=1e-6)
    # a prefill of as many rows: the prefill table's, whose least knot (16 rows) prices it
    assert fitted.step_time(StepShape((5,), (300,))) == pytest.approx(
        true_time(StepShape((16,), (300,))), rel=1e-6)


def test_a_fitted_file_without_verify_prices_verifications_as_its_prefills_to_the_bit(tmp_path):
    run = assemble(config())
    floor = RooflineCostModel(run.model_shape, run.hardware)
    shipped = yaml.safe_load((REPO / "conf" / "calibration" / "smollm2_135m_cpu.yaml").read_text())
    del shipped["coeffs"]["verify"]  # a fit made before issue 47's verification steps
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(shipped))
    old = load_fitted(tmp_path / "old.yaml", floor)
    assert set(old.coeffs) == {"decode", "prefill"}
    for new, context in (((5,), (300,)), ((2, 3, 9), (64, 512, 1500)), ((16, 40), (0, 9))):
        assert old.step_time(StepShape.verification(new, context)) == \
            old.step_time(StepShape(new, context))
    row = dict.fromkeys("abcdefgh", 0.0)
    coeffs = {"decode": row | {"a": 0.03}, "prefill": row | {"a": 0.05},
              "verify": row | {"n2": 0.04, "n5": 0.07}}
    save_fitted(tmp_path / "v.yaml", coeffs, {"model": "tiny", "device": "cpu"})
    loaded = load_fitted(tmp_path / "v.yaml", floor)
    assert loaded.coeffs == coeffs
    assert loaded.predict(StepShape.verification((4,), (10,))) == pytest.approx(0.06)
    assert loaded.predict(StepShape((4,), (10,))) == pytest.approx(0.05)
    bad = tmp_path / "bad.yaml"
    bad.write_text((tmp_path / "v.yaml").read_text().replace("  verify:", "  verified:"))
    with pytest.raises(BadInput, match=r"unknown coeffs kind 'verified' \(allowed: decode, "
                                       r"prefill, verify\)"):
        load_fitted(bad, floor)


def test_the_simulator_prices_a_speculative_step_with_the_fits_verify_coefficients(tmp_path):
    """A verification batch (entries with drafts) is a ``verify`` step to the fitted model."""
    run = assemble(config())
    floor = RooflineCostModel(run.model_shape,
                              HardwareSpec("fast", flops=1e18, mem_bw=1e18, memory_bytes=10**10))
    row = dict.fromkeys("abcdefgh", 0.0)
    fitted = FittedCostModel({"decode": row | {"a": 0.03}, "prefill": row | {"a": 0.05},
                              "verify": row | {"a": 0.02}}, floor)
    executor = SimExecutor(fitted)
    verify = synthetic_batch(StepShape.verification((5,), (64,)), 256, np.random.default_rng(0))
    prefill = synthetic_batch(StepShape((5,), (64,)), 256, np.random.default_rng(0))
    assert executor.execute(verify).gpu_s == pytest.approx(0.02)
    assert executor.execute(prefill).gpu_s == pytest.approx(0.05)
