"""``backend=server``: the testbed's workloads driven against a live OpenAI-compatible server (the
testbed's own, vLLM, SGLang) by an asyncio client, recorded as the other backends record.

- `settings`: the ``server`` config block, checked (no HTTP client imported);
- `openai_client`: ``GET /v1/models`` and one streamed ``POST /v1/completions`` (token ids in and
  out, each token-carrying chunk timed, the server's cached tokens);
- `driver`: the serving loop on the wall clock (arrivals, dependencies, think times, closed
  loops, call slots), with the simulator's rules;
- `backend`: `run_server`, from the assembled run to records and summary figures.
"""

from testbed.remote.backend import run_server

__all__ = ["run_server"]
