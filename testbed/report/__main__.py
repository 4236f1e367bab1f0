"""``python -m testbed.report DIR [--out OUT]``: write the sweep report of the runs under DIR."""

import sys

from testbed.report import main

sys.exit(main())
