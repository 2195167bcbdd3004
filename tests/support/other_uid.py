"""Run a function in a forked child process as another uid (root only), for tests that check
what a local process of another user can and cannot do against an agent."""

from __future__ import annotations

import os
from collections.abc import Callable

NOBODY = 65534


def run_as(uid: int, fn: Callable[[], bytes], gid: int | None = None, groups: list[int] | None = None) -> bytes:
    """``fn()`` in a child with uid ``uid`` (and gid ``gid``, default the same number, and the
    supplementary ``groups``, default none); returns its bytes (b"" if it raised). The child
    leaves with ``os._exit``, never through pytest's clean-up."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = b""
        try:
            os.close(r)
            os.setgroups(groups or [])
            os.setgid(uid if gid is None else gid)
            os.setuid(uid)
            out = fn()
        except BaseException:
            out = b""
        finally:
            os.write(w, out)
            os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 65536):
        got += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return got
