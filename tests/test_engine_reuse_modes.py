"""Every reuse mode runs on the engine with every CPU kernel set and every attention backend the
CPU runs without Triton's interpreter (issue 58): exact prefixes, CacheBlend-style chunk reuse and
semantic match, each a whole run through `testbed.execute.execute` that finishes with every
request served.

The runs are RAG prompts of about 270 tokens, three programs at a time: longer than the slot
table's first 256 columns, so the first (plain) step grows it (`testbed.engine.slot_table`) before
later steps mix plain entries with blended ones. Before issue 58 those steps wrote the table
outside inference mode, on a table the plain step had made inside it, and every blended run
stopped with "Inplace update to inference tensor outside InferenceMode is not allowed".
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

from testbed.execute import execute  # noqa: E402
from testbed.config.overrides import compose_config  # noqa: E402

RAG = ["backend=engine", "model=tiny", "device=cpu", "workload=rag", "workload.num_requests=12",
       "workload.corpus_docs=6", "workload.docs_per_prompt=4", "workload.doc_len=64",
       "workload.question_len=4", "workload.system_prompt_len=8", "workload.output_len=2",
       "arrival.max_in_flight=3",
       "cache=radix", "cache.capacity_tokens=2000", "progress=false",
       "debug.check_invariants=true"]
MODES = {"prefix": ["cache.reuse=prefix"],
         "blend": ["cache.reuse=blend", "cache.recompute_ratio=1.0"],
         "blend_no_recompute": ["cache.reuse=blend", "cache.recompute_ratio=0.0"],
         "semantic": ["cache.match=semantic", "cache.recompute_ratio=0.15"]}
# triton and cascade_triton run on the CPU only in Triton's interpreter (tests/conftest.py), far
# too slowly for whole runs; their kernels have tests of their own (tests/test_kernels.py)
CPU_ATTENTION = ["torch", "cascade", "cascade_torch"]


@pytest.mark.parametrize("attention", CPU_ATTENTION)
@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_reuse_mode_finishes_on_the_engine_with_each_cpu_kernel_set_and_attention(
        tmp_path, mode, kernels, attention):
    execute(compose_config([*RAG, *MODES[mode], f"engine.cpu_kernels={kernels}",
                            f"engine.attention={attention}"]), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_requests"] == 12
    assert summary["aborted_requests"] == 0
    reused = summary.get("approx_hit_tokens", 0) + summary.get("recomputed_tokens", 0)
    assert (reused > 0) == (mode != "prefix")  # the blended path ran where it should
