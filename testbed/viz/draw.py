"""Drawing `Panel`s of the radix tree with matplotlib alone (no Graphviz): one panel per step.

Every panel uses the same scale (inches per level and per sibling slot), so a tree that grows
from one panel to the next looks bigger. A node's box says how many tokens it holds, its first
token ids, its lock count and its last access (the cache's logical clock); its colour says what
happened to it since the previous panel. Evicted nodes stay, dashed and grey, where they were.
Figures are plain ``matplotlib.figure.Figure`` objects on the Agg canvas, so pyplot's backend
is left alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from testbed.viz.layout import tidy_layout
from testbed.viz.snapshot import NodeView, Panel, shorten

DPI = 110
SLOT_IN = 1.4       # least inches between neighbouring nodes, at full size (wider for long labels)
LEVEL_IN = 1.0      # inches between levels
MAX_FIGURE_IN = 48.0  # a wider or taller figure is drawn smaller, with shorter labels
MIN_FIGURE_IN = 11.5  # room for the legend in two rows
CHAR_EM = 0.64      # a digit's width in DejaVu Sans, in ems (to size slots from labels)
TOKEN_CHARS = 16    # the token line of a label is cut to this many characters
TITLE_IN = 0.85     # room above each panel for its three title lines
FONT = 9.0
TITLE_FONT = 10.0
EDGE = "#525252"

STYLE = {  # state -> (face, edge, text colour, line style), and the legend's words
    "new": ("#c7e9c0", "#238b45", "black", "-"),
    "accessed": ("#c6dbef", "#2171b5", "black", "-"),
    "unchanged": ("white", EDGE, "black", "-"),
    "evicted": ("white", "#a0a0a0", "#8c8c8c", "--"),
}
LEGEND = {
    "new": "new since the previous panel",
    "accessed": "accessed since the previous panel",
    "unchanged": "not accessed since the previous panel",
    "evicted": "evicted since the previous panel (where it was)",
}
ROOT_FACE = "#eeeeee"


def node_label(node: NodeView, max_tokens: int, full: bool = True) -> str:
    """``N tokens`` / first token ids / ``lock L · t T`` (``evicted · t T`` for a ghost)."""
    if node.parent is None:
        return "root"
    if not full:
        return str(node.size)
    words = "token" if node.size == 1 else "tokens"
    status = "evicted" if node.state == "evicted" else f"lock {node.lock_ref}"
    tokens = shorten(node.tokens, max_tokens, TOKEN_CHARS)
    return f"{node.size} {words}\n{tokens}\n{status} · t {node.last_access}"


def panel_title(index: int, panel: Panel, caption: str | None = None) -> str:
    """Three lines: the step (its caption, if given), the requests served since the previous
    panel, what they hit and evicted."""
    served = f"after {panel.served} request{'' if panel.served == 1 else 's'}"
    ids = panel.request_ids
    if not ids:
        what = "nothing served yet" if panel.served == 0 else "no request since"
    elif len(ids) <= 3:
        what = "+ " + ", ".join(ids)
    else:
        what = f"+ {ids[0]} … {ids[-1]} ({len(ids)} requests)"
    if caption:
        head, what = f"({index}) {caption}", f"{served}: {what}"
    else:
        head = f"({index}) {served}"
    if len(what) > 60:
        what = what[:59] + "…"
    capacity = "∞" if panel.capacity is None else str(panel.capacity)
    stats = (f"hit {panel.hit_tokens}/{panel.prompt_tokens} · evicted {panel.evicted_tokens} · "
             f"cached {panel.cached_tokens}/{capacity}")
    if not ids:
        stats = f"cached {panel.cached_tokens}/{capacity} tokens"
    return f"{head}\n{what}\n{stats}"


def draw_panels(panels: Sequence[Panel], title: str | None = None, cols: int = 3,
                max_tokens: int = 4, captions: Sequence[str] = ()) -> Figure:
    """One figure, the panels in rows of ``cols``, all at one scale, with a legend below;
    ``captions`` (optional, one per panel) name the steps."""
    if captions and len(captions) != len(panels):
        raise ValueError(f"{len(captions)} captions for {len(panels)} panels")
    layouts = [tidy_layout(p.children(), p.nodes[0].id) for p in panels]
    width = max(3.0, max(max(x for x, _ in pos.values()) + 1 for pos in layouts))
    levels = max(2, max(max(d for _, d in pos.values()) + 1 for pos in layouts))
    cols = max(1, min(cols, len(panels)))
    chars = max(len(line) for p in panels for n in p.nodes
                for line in node_label(n, max_tokens).splitlines())
    slot_in = max(SLOT_IN, chars * CHAR_EM * FONT / 72 + 0.3)
    rows = math.ceil(len(panels) / cols)
    scale = min(1.0, MAX_FIGURE_IN / (cols * width * slot_in))
    slot_in = slot_in * scale
    level_in = max(0.2, min(LEVEL_IN * max(scale, 0.5), MAX_FIGURE_IN / (rows * levels)))
    full = scale >= 0.75 and level_in >= 0.6  # room for three-line labels
    font = max(4.0, FONT * scale)
    panel_w, panel_h = width * slot_in, levels * level_in + TITLE_IN
    top_in = 0.5 if title else 0.15
    fig_w = max(MIN_FIGURE_IN, cols * panel_w + 0.3)
    legend_cols = 4 if fig_w >= 15 else 2  # one row of four needs 14 inches
    legend_in = 0.75 if legend_cols == 4 else 1.0
    fig_h = rows * panel_h + top_in + legend_in
    margin = (fig_w - cols * panel_w) / 2  # the panels centred
    fig = Figure(figsize=(fig_w, fig_h))
    FigureCanvasAgg(fig)
    for i, (panel, pos) in enumerate(zip(panels, layouts)):
        row, col = divmod(i, cols)
        left = (margin + col * panel_w) / fig_w
        bottom = (fig_h - top_in - (row + 1) * panel_h) / fig_h
        ax = fig.add_axes((left, bottom, panel_w / fig_w, (panel_h - TITLE_IN) / fig_h))
        _draw_tree(ax, panel, pos, width, levels, max_tokens, full, font)
        caption = captions[i] if captions else None
        ax.set_title(panel_title(i + 1, panel, caption), fontsize=TITLE_FONT,
                     loc="left", pad=4)
    if title:
        fig.suptitle(title, fontsize=14, y=1 - 0.15 / fig_h, va="top")
    handles = [Patch(facecolor=STYLE[s][0], edgecolor=STYLE[s][1], linestyle=STYLE[s][3],
                     label=LEGEND[s]) for s in LEGEND]
    fig.legend(handles=handles, loc="lower center", ncol=legend_cols, frameon=False,
               fontsize=TITLE_FONT,
               bbox_to_anchor=(0.5, 0.3 / fig_h))
    fig.text(0.5, 0.08 / fig_h, "node: tokens it holds · its first token ids · lock count · "
             "t = last access (the cache's logical clock); hit = prompt tokens found cached",
             ha="center", va="bottom", fontsize=FONT, color=EDGE)
    return fig


def _draw_tree(ax, panel: Panel, pos: dict[int, tuple[float, int]], width: float, levels: int,
               max_tokens: int, full: bool, font: float) -> None:
    xs = [x for x, _ in pos.values()]
    centre = (min(xs) + max(xs)) / 2
    ax.set_xlim(centre - width / 2, centre + width / 2)
    ax.set_ylim(-(levels - 0.5), 0.5)
    ax.set_axis_off()
    for node in panel.nodes:
        x, depth = pos[node.id]
        if node.parent is not None:
            px, pdepth = pos[node.parent]
            ghost = node.state == "evicted"
            ax.plot([px, x], [-pdepth, -depth], color=STYLE["evicted"][1] if ghost else EDGE,
                    linestyle="--" if ghost else "-", linewidth=1.0, zorder=1)
        face, edge, text, style = STYLE[node.state]
        if node.parent is None:
            face, edge = ROOT_FACE, EDGE
        ax.text(x, -depth, node_label(node, max_tokens, full), ha="center", va="center",
                fontsize=font, color=text, linespacing=1.25, zorder=3,
                bbox=dict(boxstyle="round,pad=0.35", facecolor=face, edgecolor=edge,
                          linestyle=style, linewidth=1.2))


def save(fig: Figure, path: str | Path) -> Path:
    """Write the figure; the format follows the suffix (``.png``, ``.svg``, ``.pdf``)."""
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, facecolor="white")
    return path
