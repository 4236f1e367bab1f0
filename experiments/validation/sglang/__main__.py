"""``python -m experiments.validation.sglang``: `experiments.validation.sglang.check`."""

import sys

from experiments.validation.sglang.check import main

sys.exit(main())
