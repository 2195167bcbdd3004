"""The directories an agent binds its engine socket in and generates its PKI in, and the rule
that keeps another local user from squatting them.

A directory someone else can write lets them rename the engine socket and bind their own (the
engines would then hand their KV memfds to them) or swap the generated CA and keys. So before an
agent uses such a directory it is created when missing (``mkdir`` 0700) and then ``lstat``-ed;
the agent refuses to start (``ConfigError`` naming the path, its owner and mode, and what to do)
unless:

* it is a real directory, not a symlink (give the real path instead);
* the **private fallback** ``/tmp/pdd-wire-<uid>`` (the default when ``$XDG_RUNTIME_DIR`` is
  unset): owned by this agent's euid, with no group or other permission bits at all (0700);
* any other (``$XDG_RUNTIME_DIR``, ``listen.engine_socket``'s directory, the parent of
  ``tls.auto_dir``): owned by this agent's euid or by root, and writable by group or others only
  with the sticky bit set (as ``/tmp``), where nobody can rename what is not theirs. It may be
  readable and searchable by others (``/run/pdd-wire`` 0755 or 0750, which engines of another
  uid or group traverse to reach the socket).

Only that directory is checked, not the ones above it (``/tmp`` and ``/run/user`` are safe; a
configured path's ancestors are the operator's to keep).
"""

from __future__ import annotations

import os
import pwd
import stat

from .errors import ConfigError

TMP_DIR = "/tmp"  # where the private fallback lives (a module attribute for the tests)


def private_fallback() -> str:
    return os.path.join(TMP_DIR, f"pdd-wire-{os.getuid()}")


def default_socket_dir() -> str:
    return os.environ.get("XDG_RUNTIME_DIR") or private_fallback()


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def socket_dir_key(engine_socket: str) -> str:
    """What put the engine socket in its directory, for an error about that directory:
    ``XDG_RUNTIME_DIR`` (the embedded default's, or a configured path in it), else the key."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    here = os.path.dirname(os.path.abspath(engine_socket))
    return "XDG_RUNTIME_DIR" if xdg and os.path.abspath(xdg) == here else "listen.engine_socket"


def secure_dir(path: str, key: str, *, create: bool = True) -> list[str]:
    """Create ``path`` (0700) when missing; raise ``ConfigError(key, ...)`` unless it is safe by
    the rule above (strict for the private fallback). ``create=False`` (``--check``): read
    only; a missing directory passes (the agent will create it 0700), and one that is safe but
    owned by another (non-root) uid is a warning, returned, not an error: ``--check`` run as
    root for a service that runs as that uid (the unit's ``RuntimeDirectory=``)."""
    path = os.path.abspath(path)
    private = path == os.path.abspath(private_fallback())
    try:
        if create:
            os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except FileNotFoundError:
        if create:
            raise ConfigError(key, f"cannot create the directory {path!r}") from None
        return []
    except OSError as exc:
        raise ConfigError(key, f"cannot create the directory {path!r}: {exc.strerror}") from exc
    me = os.geteuid()
    what = "the default (private) runtime directory" if private else "the directory"
    fix = ("remove it (as its owner or root) so that the agent creates it 0700, or set XDG_RUNTIME_DIR "
           "or listen.engine_socket to a directory only this user can write" if private else
           f"make it owned by uid {me} or root and not writable by group or others (or sticky), or choose "
           f"another directory ({key})")
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(key, f"{what} {path!r} is a symlink (to {os.readlink(path)!r}): refusing to start, "
                               "as whoever owns the link can point it elsewhere; give the real directory's path"
                          + (", or remove the link" if private else ""))
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(key, f"{what} {path!r} is not a directory: refusing to start; {fix}")
    mode = stat.S_IMODE(st.st_mode)
    if private:
        ok = st.st_uid == me and not mode & 0o077
        rule = f"owned by uid {me} with mode 0700"
    else:
        ok = st.st_uid in (me, 0) and not (mode & 0o022 and not mode & stat.S_ISVTX)
        rule = f"owned by uid {me} or root, not writable by group or others unless sticky"
    if not ok and not create and st.st_uid != 0 and not (mode & 0o022 and not mode & stat.S_ISVTX) and not (
            private and mode & 0o077):
        return [f"{key}: {what} {path!r} belongs to {_owner(st.st_uid)}: the agent must run as that user (as "
                f"the systemd unit does), not as uid {me}, which ran this check"]
    if not ok:
        raise ConfigError(key, f"{what} {path!r} belongs to {_owner(st.st_uid)} with mode 0{mode:03o}, "
                               f"but must be {rule} (this agent runs as uid {me}): another local user could "
                               f"replace the engine socket or the keys in it. Refusing to start; {fix}")
    return []


def engine_access_problems(path: str, mode: int, uid: int | None, gid: int | None) -> list[str]:
    """Why ``listen.engine_uid`` / ``listen.engine_gid`` could not reach the engine socket
    ``path`` of ``mode`` (connecting takes write permission on it, and search permission on its
    directory); [] when they can. Read only: a missing directory is the agent's to create 0700."""
    out = []
    if uid is not None and uid not in (0, os.geteuid()) and not mode & 0o002 and not (gid is not None and mode & 0o020):
        out.append(f"listen.engine_uid {uid} cannot connect: listen.engine_socket_mode {mode:#o} does not let other "
                   "users write the socket; set 0o666 (the agent's own uid check stays the gate), or put that "
                   "user in a group, set listen.engine_gid to it and listen.engine_socket_mode = 0o660")
    if gid is not None and not mode & 0o020:  # the socket has that group: its members get the group bits only
        out.append(f"listen.engine_gid {gid} cannot connect: listen.engine_socket_mode {mode:#o} gives the group "
                   "no write permission; set 0o660")
    if uid is not None or gid is not None:
        here = os.path.dirname(os.path.abspath(path))
        try:
            dmode = stat.S_IMODE(os.stat(here).st_mode)
        except OSError:
            dmode = 0o700  # created 0700 by the agent
        if not dmode & 0o011:
            out.append(f"the engine socket's directory {here} (mode 0{dmode:03o}) lets no other user reach the "
                       "socket: put it in a directory others may search, e.g. /run/pdd-wire (0755, the unit's "
                       "RuntimeDirectory=)")
    return out
