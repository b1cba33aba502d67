import sys

from ferry_cli.main import main

sys.exit(main())
