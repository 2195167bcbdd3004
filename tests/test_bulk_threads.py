"""Bulk threads as the OS sees them: named, so an operator's ``top -H`` (and the benchmark's CPU
split between the main loop and the bulk path) can tell them from the event loop."""

import os
import threading

from pdd_wire.transport.bulk_loop import BulkLoop, name_os_thread


def _comms() -> set[str]:
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out.add(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return out


def test_bulk_loop_thread_carries_its_name_for_the_os():
    loop = BulkLoop("pdd-bulk-7")
    loop.start()
    try:
        assert "pdd-bulk-7" in _comms()
        fut = loop.submit(_native_name())
        assert fut.result(5) == "pdd-bulk-7"
    finally:
        loop.stop()


async def _native_name() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


def test_long_names_are_cut_to_the_kernel_limit():
    got: list[str] = []

    def run() -> None:
        name_os_thread("pdd-bulk-0123456789")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            got.append(f.read().strip())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got == ["pdd-bulk-012345"]
