"""The command line's overrides: checked before Hydra composes them, and composed for scripts.

Hydra refuses an option a config group does not have (``workload=tree_of_thougt``) by listing
its search path, and a key a group does not have (``cache.capacity=100``) over six lines that
suggest appending it with ``+``. `check_overrides` says either in one line first, with what is
allowed and the closest match (``error: workload must be one of ...; got 'tree_of_thougt'; did
you mean tree_of_thought?``), as a `BadInput`: the entry points print it and exit 2
(`testbed.config.cli.check_group_choices`). `compose_config` composes a config as the command line
does, for scripts, experiments and tests, with the same one-line refusals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from testbed.errors import BadInput, check_choice, did_you_mean

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The selectable options of a config group (files starting with ``_`` are building blocks)."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml") if not p.stem.startswith("_"))


def search_dirs(argv: list[str]) -> list[Path]:
    """Config folders added by ``hydra.searchpath=[file://DIR,...]`` (your own group files)."""
    dirs = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "hydra.searchpath":
            dirs += [Path(v.strip()[len("file://"):]) for v in value.strip("[]").split(",")
                     if v.strip().startswith("file://")]
    return dirs


def check_choices(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Refuse an override that picks an option a config group does not have (in ``conf/`` or a
    folder of ``hydra.searchpath``), naming the options and the closest one."""
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    extra = search_dirs(argv)
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in groups:
            continue
        for choice in value.split(","):  # multirun lists
            options = sorted({*group_options(key, conf_dir),
                              *(o for d in extra if (d / key).is_dir()
                                for o in group_options(key, d))})
            check_choice(key, choice, options)


def first_job(argv: list[str], groups: set[str]) -> tuple[list[str], list[str]] | None:
    """The overrides of a sweep's first job split in two: what composes the config (group
    choices, ``+``/``~`` overrides, ``hydra.*``) and the keys it sets, which must exist. None
    when Hydra's parser refuses them or a sweep cannot be expanded here: Hydra then reports."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides(list(argv))
    except Exception:  # noqa: BLE001 - Hydra's own message says what is wrong with the syntax
        return None
    compose, keys = [], []
    for o in parsed:
        key = o.key_or_group
        line = o.input_line
        if o.is_sweep_override():
            try:
                first = next(iter(o.sweep_string_iterator()))
            except Exception:  # noqa: BLE001 - glob(...) needs Hydra's config loader
                return None
            line = f"{line.partition('=')[0]}={first}"
        if o.type != OverrideType.CHANGE or key.startswith("hydra") or key in groups \
                or o.package is not None:
            compose.append(line)
        else:
            keys.append(key)
    return compose, keys


def check_keys(argv: list[str], name: str = "config", conf_dir: Path = CONF_DIR) -> None:
    """Refuse an override of a key the composed config does not have (``cache.capacity=100``):
    one line naming the keys its group or block takes and the closest one."""
    flags = [a for a in argv if a.startswith("-")]
    if set(flags) - {"-m", "--multirun"}:  # --config-name, --cfg, ...: Hydra's to read
        return
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()} | {
        p.name for d in search_dirs(argv) if d.is_dir() for p in d.iterdir() if p.is_dir()}
    split = first_job([a for a in argv if a not in flags], groups)
    if split is None or not split[1]:
        return
    compose, keys = split
    try:
        cfg = _compose(compose, name, conf_dir, hydra=True)
    except Exception:  # noqa: BLE001 - a config Hydra cannot compose: Hydra's message then
        return
    choices = dict(cfg.hydra.runtime.choices)
    for key in keys:
        parts = key.split(".")
        node: Any = cfg
        for depth, part in enumerate(parts):
            if not isinstance(node, DictConfig):
                break  # below a value: Hydra says what it says
            if part not in node:
                raise BadInput(unknown_key(parts[:depth], part, node, choices))
            node = node[part]


def unknown_key(parent: list[str], part: str, node: DictConfig, choices: dict) -> str:
    """The line for ``part``, a key ``node`` (at path ``parent``) does not have."""
    allowed = [k for k in node if not (not parent and k == "hydra")]
    key = ".".join([*parent, part])
    if not parent:
        where = "the config"
    elif len(parent) == 1 and parent[0] in choices:
        where = f"{parent[0]}={choices[parent[0]]}"
    else:
        where = ".".join(parent)
    return (f"{key} is not a setting of {where}; allowed: {', '.join(map(str, allowed))}"
            + did_you_mean(part, map(str, allowed)))


def check_overrides(argv: list[str], name: str = "config", conf_dir: Path = CONF_DIR) -> None:
    """Both checks, group options first; raises `BadInput` with the one line."""
    check_choices(argv, conf_dir)
    check_keys(argv, name, conf_dir)


def _compose(overrides: list[str], name: str, conf_dir: Path, hydra: bool = False
             ) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
        return compose(name, overrides=list(overrides), return_hydra_config=hydra)


def compose_config(overrides: list[str] | tuple[str, ...] = (), name: str = "config"
                   ) -> DictConfig:
    """The config ``conf/NAME.yaml`` with these overrides, composed as ``python -m testbed.run``
    composes it (for scripts, experiments and tests); a bad override is one BadInput line."""
    from hydra.errors import HydraException

    try:
        return _compose(list(overrides), name, CONF_DIR)
    except HydraException as e:
        check_overrides(list(overrides), name)  # an unknown option or key: its own line
        # else Hydra's own advice, without its search path and links
        lines = str(e).strip().split("\n\n")[0].splitlines()
        advice = [line.strip() for line in lines if not line.startswith("See https://")]
        raise BadInput(" ".join(advice)) from None
