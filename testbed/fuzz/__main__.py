import sys

from testbed.fuzz.cli import main

sys.exit(main())
