"""structlog set-up: JSON lines when stderr is not a terminal, readable lines when it is."""

from __future__ import annotations

import logging
import sys
import time
import weakref

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "auto", stream=None) -> None:
    stream = stream or sys.stderr
    json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


_OVERFLOW = ("", "", (("more lines", "'held back'"),))  # the Repeats key of newcomers while 64 are live


class Repeats:
    """Rate-limits identical log lines: the first one goes out, the same event with the same
    fields within ``every_s`` is only counted, and the next one after that carries
    ``repeated=N`` (how many were held back). A different event or different fields go out at
    once. Not thread-safe: one per owner, used from its event loop."""

    def __init__(self, every_s: float = 30.0, clock=time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._seen: dict[tuple, list] = {}  # key -> [last emitted at, held back since]

    def __call__(self, method, event: str, *, detail: dict | None = None, **fields) -> bool:
        """Log ``event`` with ``method`` (e.g. ``logger.warning``) unless it is a repeat; True
        when it went out. ``detail``: fields written with the line but not part of what makes
        it a repeat (text that differs every time, e.g. naming a request or a key)."""
        key = (getattr(method, "__name__", ""), event, tuple(sorted((k, repr(v)) for k, v in fields.items())))
        now = self._clock()
        if key not in self._seen and len(self._seen) >= 64:  # bounded: lines past their period go first
            for k in [k for k, v in self._seen.items() if now - v[0] >= self.every_s]:
                del self._seen[k]
            if len(self._seen) >= 64:  # 64 lines in their period: a newcomer shares one more slot
                key = _OVERFLOW  # (evicting a live one made it new again: a line per call in rotation)
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.every_s:
            seen[1] += 1
            return False
        if seen is not None and seen[1]:
            fields["repeated"] = seen[1]
        self._seen[key] = [now, 0]
        method(event, **fields, **(detail or {}))
        return True


_repeats: "weakref.WeakKeyDictionary[object, Repeats]" = weakref.WeakKeyDictionary()


def limited(owner, method, event: str, *, every_s: float = 30.0, detail: dict | None = None, **fields) -> bool:
    """``Repeats`` kept per ``owner`` (a session, a listener): one line per ``every_s`` for the
    same event and fields from the same owner, the next one counting those held back."""
    rep = _repeats.get(owner)
    if rep is None:
        rep = _repeats[owner] = Repeats(every_s)
    return rep(method, event, detail=detail, **fields)
