"""A live progress bar for a run, on stderr, off when stderr is not a terminal or with --quiet."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from tqdm import tqdm

from loadtests.client import RequestRecord


class Progress:
    """Counts finished requests and shows completions, cancellations and errors as they happen."""

    def __init__(self, total: int | None, desc: str, quiet: bool = False) -> None:
        self.enabled = not quiet and sys.stderr.isatty()
        self.counts = {"ok": 0, "cancelled": 0, "error": 0}
        self.bar: Any = (
            # A terminal that reports a size of 0x0 (a bare pty) would hide the bar.
            tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=True,
                 ncols=_size().columns or 100, nrows=_size().lines or 20)
            if self.enabled
            else None
        )

    def update(self, record: RequestRecord) -> None:
        self.counts[record.status] = self.counts.get(record.status, 0) + 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(ok=self.counts["ok"], cancel=self.counts["cancelled"], err=self.counts["error"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _size() -> os.terminal_size:
    return shutil.get_terminal_size((100, 20))
