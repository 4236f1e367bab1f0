"""The public traces ``python -m testbed.data`` knows, each pinned by URL and SHA-256.

URLs point at a fixed commit of the source repository (``raw.githubusercontent.com/OWNER/REPO/
COMMIT/PATH``), so a file cannot change under a name. ``sha256`` and ``size`` were computed from
byte-identical copies of those files; ``sha256=None`` means *not pinned*: the file is fetched and
its hash reported, not verified. A file lands in the data folder under ``filename``.
"""

from __future__ import annotations

from dataclasses import dataclass

MOONCAKE = "kvcache-ai/Mooncake"
MOONCAKE_COMMIT = "3b5a594133958449a1feaf1c9e0fc1b553e34a28"
AZURE = "Azure/AzurePublicDataset"
AZURE_COMMIT = "b469a113cedca53ddc3bdea71a143dc4b7d8700c"


@dataclass(frozen=True)
class Trace:
    name: str  # what ``workload.path=data:NAME`` and ``fetch NAME`` take
    repo: str  # OWNER/REPO on GitHub
    commit: str
    source_path: str  # the file's path in the repository
    filename: str  # its name in the data folder
    format: str  # the ``workload.format`` that reads it
    sha256: str | None  # None: not pinned (fetched and reported, not verified)
    size: int | None  # bytes; None where unknown
    license: str
    about: str

    @property
    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.source_path}"

    @property
    def pinned(self) -> bool:
        return self.sha256 is not None


_TRACES = (
    Trace("mooncake_conversation", MOONCAKE, MOONCAKE_COMMIT,
          "FAST25-release/traces/conversation_trace.jsonl", "mooncake_conversation_trace.jsonl",
          "mooncake", "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
          3_029_533, "Apache-2.0",
          "Mooncake FAST'25 conversation trace: 12,031 requests over one hour"),
    Trace("mooncake_synthetic", MOONCAKE, MOONCAKE_COMMIT,
          "FAST25-release/traces/synthetic_trace.jsonl", "mooncake_synthetic_trace.jsonl",
          "mooncake", "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
          1_136_313, "Apache-2.0", "Mooncake FAST'25 synthetic trace: 3,993 requests"),
    # No copy of this file was at hand to hash, so it is not pinned (the other two Mooncake
    # files' hashes were computed from copies of them at this commit).
    Trace("mooncake_toolagent", MOONCAKE, MOONCAKE_COMMIT,
          "FAST25-release/traces/toolagent_trace.jsonl", "mooncake_toolagent_trace.jsonl",
          "mooncake", None, None, "Apache-2.0", "Mooncake FAST'25 tool-and-agent trace"),
    Trace("azure_conv_2023", AZURE, AZURE_COMMIT, "data/AzureLLMInferenceTrace_conv.csv",
          "azure_llm_inference_2023_conv.csv", "azure",
          "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8", 719_188,
          "CC-BY (cite Splitwise, ISCA'24)",
          "Azure LLM inference 2023, conversation: arrival times and lengths only"),
    Trace("azure_code_2023", AZURE, AZURE_COMMIT, "data/AzureLLMInferenceTrace_code.csv",
          "azure_llm_inference_2023_code.csv", "azure",
          "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6", 320_117,
          "CC-BY (cite Splitwise, ISCA'24)",
          "Azure LLM inference 2023, code: arrival times and lengths only"),
)
TRACES: dict[str, Trace] = {t.name: t for t in _TRACES}
