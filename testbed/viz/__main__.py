"""``python -m testbed.viz TRACE_OR_WORKLOAD --at N,M,... [--out FILE] [overrides]``.

Replays a workload through the radix cache (the replay backend's rules) and draws the tree after
the first N requests for each N in ``--at`` (0: the empty tree), one panel each.

TRACE_OR_WORKLOAD is a token trace file (``workload.format=tokens`` JSONL, docs/design.md §3;
another format with a ``workload.format=...`` override), a workload name (``chat``, ``few_shot``,
...) or a ``workload=NAME`` override. The overrides are Hydra's, composed on ``conf/config.yaml``
as ``python -m testbed.run`` composes them: ``workload.KEY=...``, ``seed=N``,
``cache.capacity_tokens=N`` (null, the default: unlimited), ``cache.page_size=P``,
``eviction=NAME``, ``arrival.kind=...``. Requests are served in arrival order, as in replay.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import DictConfig

from testbed.config.assembly import Assembly, assemble, compose_config
from testbed.cache.radix import RadixCache
from testbed.config.overrides import check_overrides
from testbed.errors import BadInput
from testbed.viz.draw import draw_panels, save
from testbed.viz.snapshot import outline, replay_panels
from testbed.workloads import WORKLOADS
from testbed.workloads.request import refuse_generating


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m testbed.viz",
        description="Draw the radix tree after chosen requests of a replayed workload.")
    p.add_argument("source", metavar="TRACE_OR_WORKLOAD",
                   help="a token trace (JSONL), a workload name, or workload=NAME")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="Hydra overrides: workload.*, seed, cache.*, eviction, arrival.*")
    p.add_argument("--at", required=True, metavar="N,M,...",
                   help="draw the tree after the first N requests (0: empty), one panel each")
    p.add_argument("--out", default="radix_tree.png", help="image file, .png or .svg "
                   "(default: radix_tree.png)")
    p.add_argument("--title", default=None, help="figure title (default: workload and cache)")
    p.add_argument("--cols", type=int, default=3, help="panels per row (default 3)")
    p.add_argument("--tokens", type=int, default=4, metavar="K",
                   help="first token ids shown per node (default 4)")
    p.add_argument("--caption", action="append", default=[], metavar="TEXT",
                   help="name a panel's step; give one per panel, in order")
    p.add_argument("--text", action="store_true", help="also print each panel's tree as text")
    return p.parse_intermixed_args(argv)


def source_overrides(source: str) -> list[str]:
    """The overrides that select the workload TRACE_OR_WORKLOAD names."""
    if "=" in source:
        return [source]
    if source in WORKLOADS and not Path(source).exists():
        return [f"workload={source}"]
    if not Path(source).is_file():
        raise BadInput(f"{source!r} is neither a trace file nor a workload "
                       f"({', '.join(WORKLOADS)})")
    return ["workload=trace", f"workload.path={Path(source).resolve()}", "workload.format=tokens"]


def parse_at(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BadInput(f"--at must be request counts separated by commas, got {text!r}") from None


def radix_cache(run: Assembly, requests) -> RadixCache:
    """The configured radix cache (its capacity, page size and eviction policy)."""
    if run.cache.label != "radix":
        raise BadInput(f"testbed.viz draws the radix tree: cache must be radix, got "
                       f"{run.cache.label!r}")
    if run.has_lower_tiers:
        raise BadInput("testbed.viz draws the GPU tree alone: cache.host_tokens and "
                       "cache.disk_tokens must be 0")
    return run.build_cache(run.capacity_tokens, requests)


def default_title(source: str, cfg: DictConfig) -> str:
    what = Path(source).name if cfg.workload.name == "trace" else f"workload={cfg.workload.name}"
    capacity = cfg.cache.get("capacity_tokens")
    size = "unlimited" if capacity is None else f"{capacity} tokens"
    pages = f", page {cfg.cache.page_size}" if cfg.cache.get("page_size", 1) > 1 else ""
    return f"Radix tree of {what} (replay; capacity {size}{pages}, eviction {cfg.eviction.name})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        overrides = [*source_overrides(args.source), *args.overrides]
        check_overrides(overrides)
        at = parse_at(args.at)
        if args.cols < 1 or args.tokens < 1:
            raise BadInput("--cols and --tokens must be >= 1")
        cfg = compose_config(overrides)
        run = assemble(cfg)
        requests = run.requests()
        refuse_generating(requests, "replay")  # the tree after replayed requests: outputs needed
        cache = radix_cache(run, requests)
        panels = replay_panels(requests, cache, at)
        if args.caption and len(args.caption) != len(panels):
            raise BadInput(f"{len(args.caption)} --caption for {len(panels)} panels")
    except (BadInput, OSError) as e:  # anything else is a defect: its traceback, exit 1
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.text:
        for i, panel in enumerate(panels, 1):
            print(f"({i}) after {panel.served} request{'' if panel.served == 1 else 's'}")
            print(outline(panel, max_tokens=args.tokens * 2, details=True))
    title = default_title(args.source, cfg) if args.title is None else args.title
    fig = draw_panels(panels, title=title or None, cols=args.cols, max_tokens=args.tokens,
                      captions=args.caption)
    path = save(fig, args.out)
    print(f"wrote {path}: {len(panels)} panels, {panels[-1].served} of {len(requests)} requests "
          f"replayed")
    return 0


if __name__ == "__main__":
    from testbed.config.cli import one_line_usage

    with one_line_usage():
        sys.exit(main())
