"""What ``python -m testbed.calibrate`` measures its cost model on: `grid`, the grid of synthetic
engine steps (shapes, batches laid out on the KV slots, timed passes), and `server_steps`, a live
server's steps recovered from the token times it streamed (``calibrate.server_runs``). The fit and
its file are testbed/calibrate.py's; the fitted model is testbed/sim/fitted.py's."""
