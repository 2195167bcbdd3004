"""A reference for the floor of the token path's latency on this host: ``python -m pdd_tools.wakeprobe``.

A token from engine A to engine B wakes three processes on its way: agent A (the engine's
request), agent B (the TOKENS frame) and engine B (the event). While a transfer keeps the cores
busy, each of those wake-ups waits for a CPU, whatever the processes woken then do. This probe
measures that part alone: a writer sends ``(seq, time)`` every ``--period`` seconds through a chain
of ``--hops`` processes, each asleep and woken by the one before over a Unix ``SOCK_SEQPACKET``
socket pair (the ones before the last forward the message at once; the last one, this process,
takes the difference). None of them is an agent or an engine, and none does any work.

On standard output: ``ready`` once the first message has crossed the whole chain, then, when the
run ends, one JSON line ``[[seq, when, ms], ...]`` (``when``: the send time on the monotonic clock
``time.perf_counter`` reads in every process on Linux; ``ms``: send to receipt). The run ends when
standard input, if it is a pipe, closes, or after ``--seconds``. ``scripts/bench --only latency``
runs it while the agents move 1 GiB transfers (``wake_latency_under_load_p99``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import time
import traceback

MSG = struct.Struct("<Qd")  # sequence number, send time


def _child(i: int, pairs: list[tuple[socket.socket, socket.socket]], period_s: float, max_s: float) -> None:
    """Process ``i`` of the chain: the writer (0) or a relay; never returns (``os._exit``)."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the parent had: the end of the run
        mine = {pairs[i][0]} | ({pairs[i - 1][1]} if i else set())
        for sock in (s for pair in pairs for s in pair):
            if sock not in mine:  # so that one end closing is seen by the process on the other
                sock.close()
        out = pairs[i][0]
        if i == 0:
            end = time.perf_counter() + max_s
            seq = 0
            while time.perf_counter() < end:
                out.send(MSG.pack(seq, time.perf_counter()))
                seq += 1
                time.sleep(period_s)
        else:
            inp = pairs[i - 1][1]
            while got := inp.recv(MSG.size):  # one message per recv (SOCK_SEQPACKET); b"": the end
                out.send(got)
        code = 0
    except (BrokenPipeError, ConnectionResetError, KeyboardInterrupt):  # the next process is gone, or
        code = 0  # a Ctrl-C on the terminal reached the whole chain: the run is over
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _stdin_is_pipe() -> bool:
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):  # closed, or no standard input at all (None)
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def run(period_s: float = 0.002, max_s: float = 60.0, hops: int = 3, *, ready=None) -> list[list[float]]:
    """The probe (see the module's docstring): ``[seq, when, ms]`` per message received.
    ``ready()`` is called once the first message has crossed the chain. Raises RuntimeError when
    a process of the chain failed."""
    if hops < 1 or period_s <= 0 or max_s <= 0:
        raise ValueError(f"hops must be >= 1 and times > 0 (hops {hops}, period {period_s}, seconds {max_s})")
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(hops)]
    pids: list[int] = []
    samples: list[list[float]] = []
    try:
        for i in range(hops):  # pairs[i] goes into the process after child i; the last one is this
            pid = os.fork()
            if pid == 0:
                _child(i, pairs, period_s, max_s)
            pids.append(pid)
        for a, b in pairs[:-1]:
            a.close()
            b.close()
        pairs[-1][0].close()
        inp = pairs[-1][1]
        watch = [inp, sys.stdin] if _stdin_is_pipe() else [inp]
        end = time.perf_counter() + max_s
        while (left := end - time.perf_counter()) > 0:
            readable, _, _ = select.select(watch, [], [], left)
            if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
                break  # standard input closed: the caller is done
            if inp not in readable:
                continue
            got = inp.recv(MSG.size)
            now = time.perf_counter()
            if len(got) != MSG.size:
                break  # the writer's time is up (or a relay failed: its status says)
            seq, sent = MSG.unpack(got)
            samples.append([seq, sent, (now - sent) * 1e3])
            if len(samples) == 1 and ready is not None:
                ready()
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()
        failed = []
        statuses = {}
        for pid in pids:  # one that has ended already (a failure, or the writer's time up) keeps
            done, status = os.waitpid(pid, os.WNOHANG)  # its status; the others are stopped
            if done:
                statuses[pid] = status
            else:
                os.kill(pid, signal.SIGTERM)  # the writer may be asleep between two messages
        for i, pid in enumerate(pids):
            if pid not in statuses:
                statuses[pid] = os.waitpid(pid, 0)[1]
                if os.WIFSIGNALED(statuses[pid]) and os.WTERMSIG(statuses[pid]) == signal.SIGTERM:
                    continue  # ours
            code = os.waitstatus_to_exitcode(statuses[pid])
            if code != 0:
                failed.append(f"process {i} of the chain (pid {pid}) "
                              + (f"exited {code}" if code > 0 else f"was killed by signal {-code}"))
    if failed:
        raise RuntimeError(f"the wake probe's chain failed ({', '.join(failed)}; a traceback, if any, is on stderr)")
    return samples


class WakeProbe:
    """:func:`run` in a process of its own (a session of its own, so that nothing of it can
    outlive :meth:`stop`), for an asyncio caller: ``probe = await WakeProbe.start()``, then
    ``samples = await probe.stop()``."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, period_s: float = 0.002, max_s: float = 300.0, hops: int = 3,
                    timeout: float = 30.0) -> "WakeProbe":
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdd_tools.wakeprobe", "--period", str(period_s), "--seconds", str(max_s),
            "--hops", str(hops), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        probe = cls(proc)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            if line.strip() != b"ready":
                raise RuntimeError(f"the wake probe did not start: {await probe._stderr()}")
        except BaseException:
            probe.kill()
            await proc.wait()
            raise
        return probe

    async def stop(self, timeout: float = 30.0) -> list[list[float]]:
        """End the run (its standard input closes) and give its ``[seq, when, ms]`` samples."""
        try:
            out, err = await asyncio.wait_for(self.proc.communicate(b""), timeout)
        except BaseException:
            self.kill()
            await self.proc.wait()
            raise
        if self.proc.returncode != 0:
            raise RuntimeError(f"the wake probe exited {self.proc.returncode}: {err.decode()[-2000:]}")
        return json.loads(out)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    async def _stderr(self) -> str:
        assert self.proc.stderr is not None
        try:
            return (await asyncio.wait_for(self.proc.stderr.read(), 5)).decode()[-2000:]
        except TimeoutError:
            return "(no error output)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdd_tools.wakeprobe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--period", type=float, default=0.002, help="seconds between two messages (0.002)")
    ap.add_argument("--seconds", type=float, default=10.0,
                    help="how long it runs unless standard input, a pipe, closes first (10)")
    ap.add_argument("--hops", type=int, default=3, help="processes each message wakes in turn (3)")
    args = ap.parse_args(argv)
    samples = run(args.period, args.seconds, args.hops, ready=lambda: print("ready", flush=True))
    print(json.dumps(samples), flush=True)
    if not samples:
        print("wakeprobe: no message crossed the chain (its standard input closed at once?)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
