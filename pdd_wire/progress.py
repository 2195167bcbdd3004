"""A one-line progress display for long work (a probe, the demo's replay): redrawn a few times
a second on stderr while it is a terminal, erased at the end; nothing at all otherwise (logs,
CI, ``--json``)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable


def bar(fraction: float, width: int = 30) -> str:
    n = max(0, min(width, int(width * fraction)))
    return f"[{'#' * n}{'.' * (width - n)}]"


class Progress:
    """``with Progress(lambda elapsed_s: "text"): ...``: ``line`` is called from a thread with
    the seconds elapsed and returns the line to show; it must only read state."""

    def __init__(self, line: Callable[[float], str], *, quiet: bool = False, stream=None,
                 every_s: float = 0.2) -> None:
        self.line = line
        self.stream = stream or sys.stderr
        self.on = not quiet and self.stream.isatty()
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.every_s):
            try:
                text = self.line(time.monotonic() - t0)
            except Exception:  # a display must never break the work it shows
                continue
            self.stream.write(f"\r\033[K{text}")
            self.stream.flush()
        self.stream.write("\r\033[K")
        self.stream.flush()

    def __enter__(self) -> "Progress":
        if self.on:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
