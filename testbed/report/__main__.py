"""``python -m testbed.report DIR [--out OUT]``: write the sweep report of the runs under DIR."""

import sys

from testbed.config.cli import one_line_usage
from testbed.report import main

with one_line_usage():
    sys.exit(main())
