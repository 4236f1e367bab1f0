"""The ``serve`` block of ``python -m testbed.serve`` (conf/serve.yaml), checked with the run config
it shares: `assemble_serve` is `testbed.config.assembly.assemble` for the server, plus the ``serve``
keys, each refused in one line naming the key and what is allowed (docs/design.md §3 "Serving
over HTTP"). It imports neither the web framework nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from omegaconf import DictConfig

from testbed.config import group_values
from testbed.config.assembly import Assembly, assemble, plain
from testbed.errors import BadInput, check_choice

SERVE_KEYS = ("host", "port", "model_name", "max_queue", "default_max_tokens", "log_level")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServeSettings:
    """The ``serve`` block of ``conf/serve.yaml``, checked (docs/design.md §3 "Serving over
    HTTP")."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # None: the model group's name, else its directory's
    max_queue: int = 256  # requests held at once (waiting or running); more: 429
    default_max_tokens: int = 256  # a request's max_tokens when it gives none
    log_level: str = "warning"  # uvicorn's


def assemble_serve(cfg: DictConfig | Mapping[str, Any]) -> tuple[Assembly, ServeSettings]:
    """`assemble` for the server: backend=engine only, the engine generating (``forced`` does
    not apply to generated calls; it is set false), plus the ``serve`` keys, each refused in one
    line naming the key and what is allowed. A random model (no ``model.path``) of a billion
    parameters or more on the CPU is refused too: it would take minutes and tens of GB to build."""
    config = dict(plain(cfg))
    block = config.pop("serve", None) or {}
    if not isinstance(block, Mapping):
        raise BadInput(f"serve must be a mapping of {', '.join(SERVE_KEYS)}, got {block!r}")
    unknown = sorted(set(block) - set(SERVE_KEYS))
    if unknown:
        raise BadInput(f"serve.{unknown[0]} is not a serve key; allowed: {', '.join(SERVE_KEYS)}")
    if (config.get("backend") or {}).get("name") != "engine":
        raise BadInput("python -m testbed.serve needs backend=engine (the model generates); got "
                       f"backend={(config.get('backend') or {}).get('name')}")
    if (config.get("replicas") or 1) != 1:
        raise BadInput("python -m testbed.serve serves one replica: replicas must be 1")
    config["engine"] = {**(config.get("engine") or {}), "forced": False}
    config["forced"] = None  # the old name of engine.forced: the model generates, whatever it says
    run = assemble(config)
    if run.speculative.active:  # the online engine's loop has no verification steps yet
        raise BadInput(f"python -m testbed.serve does not serve speculative.method="
                       f"{run.speculative.method} yet; use speculative.method=none")
    host, port, name, level = listening(block, "serve", 8000)
    settings = ServeSettings(
        host=host, port=port, model_name=name,
        max_queue=group_values.integer(block, "max_queue", "serve", minimum=1, default=256),
        default_max_tokens=group_values.integer(block, "default_max_tokens", "serve",
                                                minimum=1, default=256),
        log_level=level)
    model = run.config["model"]
    if not model.get("path") and not run.engine_device.startswith("cuda") \
            and run.model_shape.params >= 1e9:
        raise BadInput(f"model={model.get('name')} has no checkpoint (model.path) and would be a "
                       f"random {run.model_shape.params / 1e9:.1f}e9-parameter model on the CPU; "
                       "pick model=tiny, model=smollm2_135m or model.path=DIR")
    return run, settings


def listening(block: Mapping[str, Any], section: str, default_port: int
              ) -> tuple[str, int, str | None, str]:
    """``host``, ``port``, ``model_name`` and ``log_level`` of a server's block (``serve``, the
    router's ``route``), each refused in one line naming ``section.key``."""
    host = block.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise BadInput(f"{section}.host must be a host name or address, got {host!r}")
    port = group_values.integer(block, "port", section, minimum=0, default=default_port)
    if port > 65535:
        raise BadInput(f"{section}.port must be in 0..65535 (0: any free port), got {port}")
    name = block.get("model_name")
    if name is not None and (not isinstance(name, str) or not name):
        raise BadInput(f"{section}.model_name must be a non-empty string or null, got {name!r}")
    level = block.get("log_level", "warning")
    check_choice(f"{section}.log_level", level, LOG_LEVELS)
    return host, port, name, level
