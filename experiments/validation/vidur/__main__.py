"""``python -m experiments.validation.vidur``: `experiments.validation.vidur.compare`."""

from experiments import entry
from experiments.validation.vidur.compare import main

entry(main)
