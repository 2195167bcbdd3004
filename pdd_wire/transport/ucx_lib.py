"""The ucxx library, imported lazily: :func:`load`, :func:`available`, and UCX errors as ours.

Process-global effects of importing ucxx
----------------------------------------
``import ucxx`` writes ``UCX_MEMTYPE_CACHE=n``, ``UCX_RNDV_THRESH=8192``,
``UCX_RNDV_FRAG_MEM_TYPE=cuda``, ``UCX_MAX_RNDV_RAILS=1`` (and, with a GPU, maybe
``UCX_CUDA_COPY_MAX_REG_RATIO``) into ``os.environ``, where every child process inherits
them; UCX 1.21 no longer knows ``UCX_MEMTYPE_CACHE`` and warns "unused environment variable"
at every context creation. :func:`load` imports ucxx lazily (never at ``pdd_wire`` import)
and puts ``os.environ`` back as it was; UCX options then come from the real environment
(``UCX_TLS``, ...) and from :class:`~.ucx_loop.UcxLoop`'s ``options``. UCX logs to *stdout*
(``UCX_LOG_FILE=/dev/stderr`` in the environment before the first import moves it); closing
a tcp endpoint whose peer closed first logs a harmless ``flush.c ... error during flush:
Connection reset by remote peer``. Creating the UCX context probes CMA (read from UCX's
``cma_md.c``, not reproducible on this VM, which has no Yama): with
``kernel.yama.ptrace_scope=1`` UCX calls ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``, i.e.
any process of our uid may then ptrace the agent; with scope 2 it needs ``CAP_SYS_PTRACE``,
otherwise (or when a seccomp filter refuses ``process_vm_writev``) CMA is simply left out and
``sm`` rendezvous goes by copy.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

from ..errors import ErrorCode, TransportError

_import_lock = threading.Lock()
_mods: SimpleNamespace | None = None
_import_error: str | None = None
#: What ``import ucxx`` wrote into os.environ (and we undid), for the record.
UCXX_IMPORT_ENV: dict[str, str] = {}


def load() -> SimpleNamespace:
    """Import ucxx once (thread-safe), leaving ``os.environ`` as it found it. The names we use:
    ``L`` (``ucxx._lib.libucxx``), ``Array``, ``Tag``, ``TagMask``, ``UCXError``, and the
    versions. Raises :class:`TransportError` when ucxx cannot be imported."""
    global _mods, _import_error
    with _import_lock:
        if _mods is not None:
            return _mods
        if _import_error is not None:   # failed before: a retry would fail the same way
            raise TransportError(_import_error)
        before = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "UCXPY_"))}
        try:
            import ucxx
            from ucxx._lib import libucxx
            from ucxx._lib.arr import Array
            from ucxx.types import Tag, TagMask
        except ImportError as exc:
            _import_error = (f"ucxx is not importable ({type(exc).__name__}: {exc}); "
                             "install the 'ucx' extra: pip install 'pdd-wire[ucx]'")
            raise TransportError(_import_error) from exc
        except OSError as exc:
            _import_error = f"ucxx could not load the UCX libraries: {exc}"
            raise TransportError(_import_error) from exc
        except Exception as exc:  # a broken install shows up as anything
            _import_error = f"ucxx failed to import: {type(exc).__name__}: {exc}"
            raise TransportError(_import_error) from exc
        finally:
            for k in [k for k in os.environ if k.startswith(("UCX_", "UCXPY_"))]:
                if k not in before:
                    UCXX_IMPORT_ENV[k] = os.environ.pop(k)
                elif os.environ[k] != before[k]:
                    UCXX_IMPORT_ENV[k] = os.environ[k]
                    os.environ[k] = before[k]
        _mods = SimpleNamespace(
            L=libucxx, Array=Array, Tag=Tag, TagMask=TagMask, UCXError=libucxx.UCXError,
            version=str(getattr(ucxx, "__version__", "?")),
            ucx_version=".".join(map(str, libucxx.get_ucx_version())),
        )
        return _mods


def available() -> tuple[bool, str]:
    """``(True, "ucxx 0.52.00, UCX 1.21.0")`` when the UCX path can be used, else
    ``(False, why)``. Imports ucxx on first call (never at ``pdd_wire`` import time)."""
    try:
        m = load()
    except TransportError as exc:
        return False, str(exc)
    return True, f"ucxx {m.version}, UCX {m.ucx_version}"


def translate(exc: BaseException, what: str) -> TransportError:
    """A UCX exception as a TransportError naming the UCX error."""
    name = type(exc).__name__
    code = ErrorCode.PEER_UNREACHABLE
    if "Truncated" in name:
        code = ErrorCode.SIZE_MISMATCH
    elif "Canceled" in name:
        code = ErrorCode.TRANSFER_CANCELLED
    err = TransportError(f"UCX {what} failed: {name}: {exc}", code)
    err.ucx_error = name  # type: ignore[attr-defined]
    return err
