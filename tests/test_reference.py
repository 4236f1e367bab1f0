"""docs/reference.md against conf/, and the docs' relative links.

The reference is the one list of config groups, options and keys (docs/design.md §3 points to it).
These tests read its tables and check them against the YAML files in ``conf/``: every group and
each of its options, every key of ``conf/config.yaml``, of each option's file and of the other
entry points' configs, with its default; nothing listed that ``conf/`` lacks. A change to
``conf/`` without the reference (or the other way round) fails here.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
REFERENCE = REPO / "docs" / "reference.md"
NOT_GROUPS = {"calibration"}   # fitted step-time models, read by path (cost_model.path)


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """Leaves of a YAML mapping by dotted key; lists are leaves."""
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def conf_keys(path: Path) -> dict[str, object]:
    """A config file's own keys and values, without Hydra's defaults list and the option's name."""
    data = yaml.safe_load(path.read_text()) or {}
    data.pop("defaults", None)
    data.pop("name", None)
    return flatten(data)


def cells(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` inside a cell is text)."""
    parts = re.split(r"(?<!\\)\|", line.strip())
    return [p.strip() for p in parts[1:-1]]


def code(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def value(text: str) -> object:
    return yaml.safe_load(text)


def sections(text: str, level: str) -> dict[str, str]:
    """Body of each heading of the given level (``##`` or ``###``) by its title."""
    out: dict[str, str] = {}
    pattern = rf"^{level} (.+)$"
    heads = list(re.finditer(pattern, text, flags=re.M))
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        # stop at a heading of a higher level
        nxt = re.search(r"^#{1,%d} " % (len(level) - 1), text[m.end():end], flags=re.M) if len(level) > 1 else None
        out[m.group(1).strip()] = text[m.end(): m.end() + nxt.start()] if nxt else text[m.end():end]
    return out


def rows(body: str) -> list[list[str]]:
    """Data rows of the first table in ``body`` (header and rule left out)."""
    lines = [l for l in body.splitlines() if l.startswith("|")]
    return [cells(l) for l in lines[2:]]


@pytest.fixture(scope="module")
def ref() -> str:
    return REFERENCE.read_text()


def conf_groups() -> dict[str, Path]:
    groups = {}
    for d in sorted(p for p in CONF.rglob("*") if p.is_dir()):
        if d.name in NOT_GROUPS or not any(d.glob("*.yaml")):
            continue
        groups[d.relative_to(CONF).as_posix()] = d
    return groups


def group_sections(ref: str) -> dict[str, str]:
    body = sections(ref, "##")["Config groups"]
    return {code(title)[0]: text for title, text in sections(body, "###").items()}


def test_every_group_is_documented_and_nothing_else(ref):
    assert sorted(group_sections(ref)) == sorted(conf_groups())


def test_group_defaults_match_config_yaml(ref):
    chosen = {}
    for d in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]:
        if isinstance(d, dict):
            chosen.update(d)
    for group, body in group_sections(ref).items():
        m = re.search(r"^Default: `([^`]+)`", body, flags=re.M)
        if group in chosen:
            assert m and m.group(1) == chosen[group], group
        else:
            assert not m, f"{group} has no default in conf/config.yaml"


@pytest.mark.parametrize("group", sorted(conf_groups()))
def test_options_of_each_group(ref, group):
    body = group_sections(ref)[group]
    m = re.search(r"Options: (.+?)\.$", body, flags=re.M)
    assert m, f"{group}: no 'Options:' line"
    listed = code(m.group(1))
    options = sorted(p.stem for p in conf_groups()[group].glob("*.yaml") if not p.stem.startswith("_"))
    assert sorted(listed) == options


@pytest.mark.parametrize("group", sorted(g for g in conf_groups() if g != "experiment"))
def test_keys_and_defaults_of_each_option(ref, group):
    documented: dict[tuple[str, str], object] = {}
    keyless: set[str] = set()
    for r in rows(group_sections(ref)[group]):
        option, key, default = code(r[0])[0], r[1], r[2]
        if key == "—":
            keyless.add(option)
            continue
        documented[(option, code(key)[0])] = value(code(default)[0])
    expected: dict[tuple[str, str], object] = {}
    for path in conf_groups()[group].glob("*.yaml"):
        keys = conf_keys(path)
        expected.update({(path.stem, k): v for k, v in keys.items()})
        if not keys:
            assert path.stem in keyless, f"{group}={path.stem} is not listed"
    assert keyless <= {p.stem for p in conf_groups()[group].glob("*.yaml")}
    assert sorted(documented) == sorted(expected)
    for k, v in expected.items():
        assert documented[k] == v, f"{group}={k[0]} {k[1]}: documented {documented[k]!r}, conf has {v!r}"


def test_experiment_presets(ref):
    documented = {}
    for r in rows(group_sections(ref)["experiment"]):
        sets = dict(c.split("=", 1) for c in code(r[1]))
        sweeps = dict(c.split("=", 1) for c in code(r[2]))
        documented[code(r[0])[0]] = (sets, sweeps, code(r[3]))
    expected = {}
    for path in (CONF / "experiment").glob("*.yaml"):
        keys = conf_keys(path)
        sets = {k: v for k, v in keys.items() if not k.startswith("hydra.")}
        sweeps = {k[len("hydra.sweeper.params."):]: v for k, v in keys.items()
                  if k.startswith("hydra.sweeper.params.")}
        expected[path.stem] = (sets, sweeps, [keys["hydra.sweep.dir"]])
    assert sorted(documented) == sorted(expected)
    for name, (sets, sweeps, into) in expected.items():
        d_sets, d_sweeps, d_into = documented[name]
        assert {k: value(v) for k, v in d_sets.items()} == sets, name
        assert {k: value(v) for k, v in d_sweeps.items()} == sweeps, name
        assert d_into == into, name


def test_top_level_keys(ref):
    documented = {code(r[0])[0]: value(code(r[1])[0])
                  for r in rows(sections(ref, "##")["Top-level keys (`conf/config.yaml`)"])}
    assert documented == conf_keys(CONF / "config.yaml")


def test_other_entry_points(ref):
    documented = {(code(r[0])[0], code(r[1])[0]): value(code(r[2])[0])
                  for r in rows(sections(ref, "##")["Other entry points"])}
    expected = {}
    for name in ("calibrate.yaml", "describe.yaml", "serve.yaml", "route.yaml"):
        keys = conf_keys(CONF / name)
        expected.update({(name, k): v for k, v in keys.items() if not k.startswith("hydra.")})
    assert documented == expected
    top = {p.name for p in CONF.glob("*.yaml")}
    assert top == {"config.yaml", "calibrate.yaml", "describe.yaml", "serve.yaml",
                   "route.yaml"}, \
        "a new entry point's config"


# --- links -------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]


def strip_code(text: str) -> str:
    """Text without fenced blocks and code spans, where a ``[x](y)`` is not a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_the_readme_is_read_in_five_minutes():
    """At most 200 lines (issue 60): what it is, the two commands, the tour, the headline and the
    index; provenance (hosts, commits, dates, skips) lives on the pages it describes."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


# the development machine's folder beside the checkout: only tests/ and .ci/ may look there
SHARED = re.compile(r"\.\./shared|/work/shared|parents?\b[^\n]*\"shared\"|\bshared/(vidur|traces)")
TEXT = {".md", ".py", ".sh", ".yaml", ".toml", ".cfg", ".txt"}


def test_no_document_script_or_make_target_names_the_shared_folder():
    """A user's checkout has no ``../shared``: what the repository says and runs must not need it
    (issue 60); measurement artifacts (JSON, CSV) record the paths their runs read, as they were."""
    named = []
    for path in sorted(REPO.rglob("*")):
        rel = path.relative_to(REPO).as_posix()
        if rel.split("/")[0] in {".git", ".venv", "tests", ".ci", "outputs", "multirun", ".whl"} \
                or not path.is_file() or not (path.suffix in TEXT or path.name == "Makefile"):
            continue
        named += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                  if SHARED.search(line)]
    assert not named, named


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(md):
    broken = []
    for target in LINK.findall(strip_code(md.read_text())):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue   # a URL or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (md.parent / path).exists():
            broken.append(target)
    assert not broken, f"{md.relative_to(REPO)}: links to missing files: {broken}"
