"""``python -m loadtests``: the same as ``ferry bench``."""

import sys

from loadtests.cli import main

sys.exit(main())
