"""A GGUF checkpoint converted once into an HF safetensors directory (``data:NAME`` of a model).

transformers reads GGUF files (with the ``gguf`` and ``accelerate`` packages: ``pip install -e
'.[real]'``), dequantizing to fp32, but refuses to ``save_pretrained`` a model it loaded that way.
So the directory is written piece by piece: ``model.safetensors`` (the fp32 state dict, without
``lm_head.weight`` when the embeddings are tied, as HF saves tied models), ``config.json`` (without
``quantization_config``, ``architectures`` set: vLLM needs it), ``generation_config.json``, the
tokenizer's files and its chat template. It is written into a temporary folder beside the
destination and renamed, with `SOURCE_RECORD` written last: a directory with that record naming
the GGUF file's SHA-256 and its files at their recorded sizes is a finished conversion.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from testbed.errors import BadInput

SOURCE_RECORD = "testbed_source.json"
NEEDS = ("gguf", "accelerate")  # besides transformers, torch and safetensors


def missing_packages() -> list[str]:
    return [name for name in NEEDS if importlib.util.find_spec(name) is None]


def converted(directory: Path, sha256: str) -> bool:
    """Whether ``directory`` is a finished conversion of the GGUF file with hash ``sha256``."""
    try:
        record = json.loads((directory / SOURCE_RECORD).read_text())
        return record["sha256"] == sha256 and all(
            (directory / name).stat().st_size == size for name, size in record["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging

    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


def convert_gguf(gguf: Path, dest: Path, sha256: str, source: str = "") -> dict:
    """Write the HF directory ``dest`` from the GGUF file ``gguf`` (hash ``sha256``, checked by the
    caller; ``source`` names where it came from, for the record). Returns the record. Raises
    BadInput (one line) when ``gguf``/``accelerate`` are missing or transformers cannot read the
    file; a failed conversion leaves no directory behind."""
    missing = missing_packages()
    if missing:
        raise BadInput(f"converting {gguf.name} needs the packages {', '.join(missing)}: "
                        "pip install -e '.[real]' (or make real), then fetch again")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"note: converting {gguf.name} into {dest} (fp32 safetensors; about a minute)",
          file=sys.stderr)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        with _quiet_transformers():
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
                model = AutoModelForCausalLM.from_pretrained(str(gguf.parent),
                                                             gguf_file=gguf.name,
                                                             dtype=torch.float32)
            except (OSError, ValueError, KeyError) as e:
                raise BadInput(f"transformers cannot read {gguf}: "
                                f"{' '.join(str(e).split())}") from None
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous() for k, v in state.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(str(tmp))
        config = json.loads((tmp / "config.json").read_text())
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        record = {"source": source, "file": gguf.name, "sha256": sha256,
                  "model_safetensors_sha256": _sha256(tmp / "model.safetensors"),
                  "converted_s": round(time.perf_counter() - start, 1),
                  "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}}
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        for path in tmp.iterdir():  # safetensors writes 0600; a data folder may be shared
            path.chmod(0o644)
        tmp.chmod(0o755)  # as mkdtemp's 0700
        if dest.exists():  # an unfinished or stale conversion
            shutil.rmtree(dest)
        tmp.rename(dest)
        return record
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
