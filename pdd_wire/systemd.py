"""Minimal, dependency-free ``sd_notify(3)`` client.

systemd starts a ``Type=notify`` service with ``$NOTIFY_SOCKET`` set to the
address of an ``AF_UNIX``/``SOCK_DGRAM`` socket.  The service reports its state
by sending newline-separated ``KEY=VALUE`` assignments to it as one datagram:
``READY=1`` once it accepts work, ``STOPPING=1`` when it begins shutting down,
``STATUS=...`` for the one-line text shown by ``systemctl status``.

Every function here is a no-op outside systemd (``$NOTIFY_SOCKET`` unset) and
never raises: losing a status message must never take the daemon down.  They
return ``True`` only when the datagram was handed to the socket.

Supported addresses are a filesystem path (starting with ``/``) and a Linux
abstract socket (starting with ``@``, which stands for the leading NUL byte).
Other forms (``vsock:``, relative paths) are not supported and return
``False``.

The calls are blocking but bounded: a datagram to a local Unix socket either
queues immediately or fails; the socket is put in non-blocking mode so a full
receive queue yields ``False`` rather than a stall of the event loop.
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify", "notify_ready", "notify_stopping", "notify_status"]


def _address() -> str | None:
    """Return the ``$NOTIFY_SOCKET`` address in a form ``sendto`` accepts.

    Returns ``None`` when the variable is unset, empty, or of a form this
    module does not support.
    """
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        return "\0" + addr[1:]
    if addr.startswith("/"):
        return addr
    return None


def _one_line(text: str) -> str:
    # A newline would end the STATUS= assignment and let the rest of the text
    # be parsed as further assignments (e.g. a stray "READY=1").
    return " ".join(text.splitlines())


def notify(state: str) -> bool:
    """Send ``state`` to the service manager.

    Args:
        state: one or more newline-separated ``KEY=VALUE`` assignments, as
            documented in ``sd_notify(3)``, e.g. ``"READY=1\\nSTATUS=up"``.
            Sent verbatim (UTF-8); use the helpers below for escaping.

    Returns:
        ``True`` if the datagram was sent; ``False`` if ``$NOTIFY_SOCKET`` is
        unset or unsupported, ``state`` is empty, or sending failed for any
        reason (socket gone, permission denied, queue full).  Never raises and
        logs nothing.
    """
    addr = _address()
    if addr is None or not state:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.sendto(state.encode("utf-8", "replace"), addr)
    except (OSError, ValueError):
        # ValueError: an embedded NUL in a path address.
        return False
    return True


def notify_ready(status: str | None = None) -> bool:
    """Tell the service manager that start-up is complete (``READY=1``).

    For a ``Type=notify`` unit, ``systemctl start`` returns, and units ordered
    after this one start, only once this has been sent.  Send it after the
    daemon's listening sockets are bound and it accepts work.

    Args:
        status: optional one-line status text sent in the same datagram
            (``STATUS=``); newlines are replaced by spaces.

    Returns:
        See :func:`notify`.
    """
    state = "READY=1"
    if status is not None:
        state += "\nSTATUS=" + _one_line(status)
    return notify(state)


def notify_stopping() -> bool:
    """Tell the service manager that shutdown has begun (``STOPPING=1``).

    Send it when the daemon starts draining (e.g. on SIGTERM), so that
    ``systemctl status`` shows the unit as deactivating while in-flight
    transfers finish within ``TimeoutStopSec=``.

    Returns:
        See :func:`notify`.
    """
    return notify("STOPPING=1")


def notify_status(text: str) -> bool:
    """Set the free-form status line shown by ``systemctl status``.

    Args:
        text: one-line, human-readable status (e.g. ``"3 peers, 12 transfers
            in flight"``); newlines are replaced by spaces.

    Returns:
        See :func:`notify`.
    """
    return notify("STATUS=" + _one_line(text))
