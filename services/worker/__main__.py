"""``python -m services.worker``: one model worker rank (see service.py)."""

import sys

from .service import main

if __name__ == "__main__":
    sys.exit(main())
