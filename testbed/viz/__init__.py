"""The radix tree, drawn: ``python -m testbed.viz`` (docs/design.md §3).

`snapshot` replays a workload and reads the tree after chosen requests (`Panel`s, with the nodes
evicted since the previous one kept as ghosts); `layout` places a tree's nodes; `draw` renders
panels with matplotlib; `__main__` is the command line.
"""

from testbed.viz.snapshot import NodeView, Panel, outline, replay_panels

__all__ = ["NodeView", "Panel", "outline", "replay_panels"]
