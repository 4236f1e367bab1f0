"""``python -m experiments.validation.sglang``: `experiments.validation.sglang.check`."""

from experiments import entry
from experiments.validation.sglang.check import main

entry(main)
