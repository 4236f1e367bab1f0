"""What a run produces: `metrics` its per-request records and summary (the ``summary.json`` /
``requests.jsonl`` contract), `rundir` the run directory's files (results, ``failed.json``, whether
a sweep's run is done), `timeline` its ``timeline.json`` (Chrome trace events). `testbed.report`
reads these files back."""
