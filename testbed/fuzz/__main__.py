import sys

from testbed.config.cli import one_line_usage
from testbed.fuzz.cli import main

with one_line_usage():
    sys.exit(main())
