"""lz4 for KV chunks on the WAN leg, with a byte shuffle for 16-bit KV and the on/off rule.

Pure: no I/O, no sockets, no clocks. The caller times its own calls and feeds the figures to
an :class:`Estimator`, which says per link whether compression raises goodput.

**Byte shuffle.** A 16-bit KV chunk (fp16 or bf16, little endian) is rewritten as all low bytes
then all high bytes; an odd trailing byte stays last. The high bytes hold the sign and the
exponent (bf16: sign + 7 exponent bits; fp16: sign + 5 exponent bits + 2 mantissa bits) and
take few values, so lz4 finds repeats in that half; the low bytes are mantissa and barely
compress. With numpy importable the split is two SIMD casts (~7 GB/s each way here; numpy is
not a dependency), else ``bytes[0::2]`` slicing, which runs in C (~1.5 GB/s shuffle, ~2.3 GB/s
unshuffle) but holds the GIL meanwhile.

**Payload.** ``encode_chunk`` returns an lz4 block without a size header (the receiver knows the
chunk's size), or the chunk itself, unshuffled, when lz4 would not make it smaller. The rule
``len(payload) == len(chunk)`` <=> stored, ``len(payload) < len(chunk)`` <=> lz4, holds by
construction, so no flag is needed to tell the two apart and the worst case costs no bytes.
``decode_chunk`` finds structural corruption and size mismatches (:class:`CompressedChunkError`);
lz4 has no checksum of its own, so a flipped literal byte passes: the chunk's xxh3 catches that.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import lz4.block

try:  # optional: only the shuffle's speed depends on it
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the environment
    _np = None  # type: ignore[assignment]

HAVE_NUMPY = _np is not None
#: Use numpy for the shuffle when it is importable. Tests set this to False for the pure path.
USE_NUMPY = HAVE_NUMPY

#: The relative goodput gain that compression must bring before it is switched on.
DEFAULT_MARGIN = 0.10

Buffer = Any  # bytes, bytearray, memoryview, mmap, or anything else with the buffer protocol


class CompressedChunkError(ValueError):
    """A compressed chunk is corrupt, or does not decompress to the expected size."""


def _load_decompress_safe():
    """``LZ4_decompress_safe`` from python-lz4's own extension (the very lz4 that compressed),
    which exports it; None where it does not. It decompresses straight into the destination,
    where ``lz4.block.decompress`` can only return a new bytes object to copy from."""
    try:
        fn = ctypes.CDLL(lz4.block._block.__file__).LZ4_decompress_safe
    except (AttributeError, OSError):  # pragma: no cover - depends on the lz4 build
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int  # bytes written, or < 0 for a malformed block; ctypes drops the GIL
    return fn


_LZ4_DECOMPRESS_SAFE = _load_decompress_safe()
#: Decompress straight into the destination through ctypes when possible. Tests flip it.
USE_CTYPES = _LZ4_DECOMPRESS_SAFE is not None


_local = threading.local()


def _scratch(n: int, slot: int = 0) -> bytearray:
    """A per-thread reusable buffer of at least ``n`` bytes (no fresh 4 MiB allocation and page
    faults per chunk). Slot 0 holds a shuffled or decompressed chunk; slot 1 is the pure-Python
    unshuffle's staging buffer, so the two can be in use at once."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = [bytearray(0), bytearray(0)]
    if len(bufs[slot]) < n:
        bufs[slot] = bytearray(n)
    return bufs[slot]


def _flat(buf: Buffer) -> memoryview:
    mv = memoryview(buf)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def _sliceable(mv: memoryview) -> bytes | bytearray:
    """An object whose ``[0::2]`` slicing runs in C over the bytes of ``mv`` (memoryview's own
    strided slicing is ~10x slower): the exporter itself when it is exactly this view, else a copy."""
    obj = mv.obj
    if isinstance(obj, (bytes, bytearray)) and len(obj) == mv.nbytes:
        return obj
    return mv.tobytes()


def _shuffle_into(src: memoryview, out: memoryview) -> None:
    """Byte planes of ``src`` into ``out`` (same length, contiguous bytes)."""
    n = len(src)
    even = n & ~1
    half = even >> 1
    if USE_NUMPY and _np is not None:
        # The 16-bit words cast down to uint8 keep their low byte; read big-endian, their high
        # byte. Two SIMD casts (~7 GB/s here) instead of two strided byte copies (~3 GB/s).
        o = _np.frombuffer(out, dtype=_np.uint8, count=n)
        _np.copyto(o[:half], _np.frombuffer(src, dtype="<u2", count=half), casting="unsafe")
        _np.copyto(o[half:even], _np.frombuffer(src, dtype=">u2", count=half), casting="unsafe")
    else:
        s = _sliceable(src)
        out[:half] = s[0:even:2]
        out[half:even] = s[1:even:2]
    if n != even:
        out[even] = src[even]


def shuffle16(src: Buffer) -> bytes:
    """All low bytes of the 16-bit elements of ``src``, then all high bytes; an odd trailing byte
    stays at the end. ``unshuffle16_into`` is the inverse."""
    mv = _flat(src)
    n = len(mv)
    if not (USE_NUMPY and _np is not None):
        s = _sliceable(mv)
        even = n & ~1
        return b"".join((s[0:even:2], s[1:even:2], s[even:]))
    out = bytearray(n)
    _shuffle_into(mv, memoryview(out))
    return bytes(out)


def unshuffle16_into(src: Buffer, dst: memoryview) -> None:
    """Write the inverse of :func:`shuffle16` of ``src`` into ``dst`` (``len(dst) == len(src)``;
    the two must not overlap)."""
    s = _flat(src)
    d = _flat(dst)
    n = len(d)
    if len(s) != n:
        raise ValueError(f"unshuffle16_into: source has {len(s)} bytes, destination {n}")
    even = n & ~1
    half = even >> 1
    if even == 0:
        pass  # (an empty extended-slice store into a bytearray counts as a resize: skip it)
    elif USE_NUMPY and _np is not None:
        # word = high << 8 | low, computed as little-endian uint16 straight into dst (~7 GB/s).
        words = _np.frombuffer(d, dtype="<u2", count=half)
        planes = _np.frombuffer(s, dtype=_np.uint8, count=even)
        _np.left_shift(planes[half:], 8, out=words, dtype="<u2")
        _np.bitwise_or(words, planes[:half], out=words)
    else:
        # Strided stores into a bytearray run in C (~2.3 GB/s here); into an arbitrary memoryview
        # (shared memory, mmap) they go element by element (~0.2 GB/s). Hence the scratch and one
        # memmove, unless the destination is a whole bytearray.
        obj = d.obj
        direct = isinstance(obj, bytearray) and len(obj) == n
        tmp = obj if isinstance(obj, bytearray) and direct else _scratch(even, 1)
        tmp[0:even:2] = s[:half]
        tmp[1:even:2] = s[half:even]
        if not direct:
            d[:even] = memoryview(tmp)[:even]
    if n != even:
        d[even] = s[even]


def _lz4_args(level: int) -> dict:
    if level == 0:
        return {"mode": "default"}
    if level < 0:
        return {"mode": "fast", "acceleration": -level}
    return {"mode": "high_compression", "compression": level}


def encode_chunk(data: Buffer, *, shuffle: bool, level: int = 0) -> bytes | memoryview:
    """The payload for one chunk: an lz4 block of (shuffled, if ``shuffle``) ``data`` without size
    header, or the chunk itself, uncopied, when lz4 does not make it smaller (then
    ``len(payload) == len(data)``).

    ``level``: 0 is lz4's default mode; ``-k`` its fast mode with acceleration k; ``k > 0`` its
    high-compression mode at level k (about 40x slower, only for very slow links).
    """
    mv = _flat(data)
    n = len(mv)
    if n == 0:
        return b""
    if shuffle:
        src = memoryview(_scratch(n))[:n]
        _shuffle_into(mv, src)
    else:
        src = mv
    packed = lz4.block.compress(src, store_size=False, **_lz4_args(level))
    if len(packed) >= n:
        return data if isinstance(data, bytes) else mv  # stored: the chunk itself, not a copy of it
    return packed


def is_stored(payload_len: int, chunk_len: int) -> bool:
    """True when a payload of ``payload_len`` bytes for a ``chunk_len``-byte chunk is the chunk
    itself rather than an lz4 block (see the module docstring)."""
    return payload_len == chunk_len


def decode_chunk(payload: Buffer, dst: memoryview, *, shuffle: bool) -> None:
    """Write the chunk that ``payload`` (from :func:`encode_chunk`) encodes into ``dst``, whose
    length is the chunk's size. ``shuffle`` must be what the sender used.

    Without shuffle the block is decompressed straight into ``dst`` (ctypes, see
    :data:`USE_CTYPES`); with shuffle into a per-thread scratch buffer, and the unshuffle is
    the one pass that writes ``dst``. (``lz4.block.decompress`` returns a new bytes object to
    copy from: 1.2-1.3 GB/s against 12-15 GB/s direct for a 4 MiB fp16 chunk here; it is the
    fallback where the lz4 build does not export ``LZ4_decompress_safe``.) Raises
    :class:`CompressedChunkError` when the payload is longer than the chunk, is not a valid lz4
    block, or decompresses to another size; ``dst`` may then hold partial data.
    """
    d = _flat(dst)
    n = len(d)
    p = _flat(payload)
    m = len(p)
    if m == n:
        d[:] = p
        return
    if m > n:
        raise CompressedChunkError(f"compressed chunk of {m} bytes is larger than the {n}-byte chunk")
    if m == 0:
        raise CompressedChunkError(f"empty payload for a {n}-byte chunk")
    if USE_CTYPES and _LZ4_DECOMPRESS_SAFE is not None and n < 1 << 31:
        target = memoryview(_scratch(n))[:n] if shuffle else d
        src = payload if isinstance(payload, bytes) else (p if not p.readonly else p.tobytes())
        src_arg = src if isinstance(src, bytes) else (ctypes.c_char * m).from_buffer(src)
        dst_arg = (ctypes.c_char * n).from_buffer(target)
        try:
            got = _LZ4_DECOMPRESS_SAFE(src_arg, dst_arg, m, n)
        finally:
            del src_arg, dst_arg  # release the exports on the buffers at once
        if got < 0:
            raise CompressedChunkError(f"corrupt lz4 block ({m} bytes for a {n}-byte chunk): error {got}")
        out = target
    else:
        try:
            out = lz4.block.decompress(p, uncompressed_size=n)
        except lz4.block.LZ4BlockError as e:
            raise CompressedChunkError(f"corrupt lz4 block ({m} bytes for a {n}-byte chunk): {e}") from None
        got = len(out)
    if got != n:
        raise CompressedChunkError(f"lz4 block decompressed to {got} bytes, expected {n}")
    if shuffle:
        unshuffle16_into(out, d)
    elif out is not d:
        d[:] = out


def goodput_with_compression(link_Bps: float, ratio: float, compress_Bps: float, decompress_Bps: float,
                             cpu_budget: float = 1.0) -> float:
    """Uncompressed bytes per second delivered through a link with compression on:
    ``min(link_Bps * ratio, compress_Bps * cpu_budget, decompress_Bps * cpu_budget)``.
    See :func:`worth_compressing`."""
    return min(link_Bps * ratio, compress_Bps * cpu_budget, decompress_Bps * cpu_budget)


def worth_compressing(link_Bps: float, ratio: float, compress_Bps: float, decompress_Bps: float,
                      cpu_budget: float = 1.0, *, margin: float = DEFAULT_MARGIN) -> bool:
    """Whether lz4 raises a link's goodput, by at least ``margin`` (0.10 = 10%).

    Chunks are compressed, sent and decompressed as a pipeline, so the slowest stage sets the
    rate. In uncompressed bytes per second::

        without: G0 = link_Bps
        with:    G1 = min(link_Bps * ratio,                 # the link carries 1/ratio of the bytes
                          compress_Bps * cpu_budget,         # sender's lz4 (+ shuffle)
                          decompress_Bps * cpu_budget)       # receiver's lz4 (+ unshuffle)
        on  <=>  G1 >= G0 * (1 + margin)

    ``ratio`` is uncompressed / compressed bytes (>= 1 means smaller). ``compress_Bps`` and
    ``decompress_Bps`` are one thread's rates in uncompressed bytes per second; ``cpu_budget``
    is how many such threads (cores) each side gives this link's (de)compression. So: a slow
    link with a good ratio -> on (G1 ~ link * ratio); a link faster than one core's lz4 -> off;
    ratio <= 1 + margin -> off on any link. Latency (one chunk's compression time, ~1-2 ms per
    4 MiB) is not counted; the margin absorbs estimate noise and keeps marginal cases off.
    """
    if link_Bps <= 0 or ratio <= 0 or compress_Bps <= 0 or decompress_Bps <= 0 or cpu_budget <= 0:
        return False
    g1 = goodput_with_compression(link_Bps, ratio, compress_Bps, decompress_Bps, cpu_budget)
    return g1 >= link_Bps * (1.0 + margin)


class Estimator:
    """Running estimates of lz4's ratio and speed on one link's real chunks, and the on/off answer.

    ``feed(nbytes_in, nbytes_out, seconds)`` after compressing a chunk (``nbytes_in``: chunk
    bytes, ``nbytes_out``: payload bytes, ``seconds``: the encode time, shuffle included);
    ``feed_decompress(nbytes, seconds)`` with the receiver's decode figures when they are known
    (else ``decompress_Bps`` below, or failing that the compression rate, stands in: lz4
    decompresses several times faster than it compresses, so this errs toward "off").

    Each quantity is an exponentially weighted moving average with weight ``alpha`` for the
    newest sample; the first sample sets it. The ratio and the rates are ratios of the averaged
    byte counts and times, so a few small chunks do not swing them. ``decide`` answers False until
    ``min_samples`` chunks were fed. While compression is off the caller should still encode a
    sample chunk now and then (e.g. 1 in 64) to keep the estimates live.

    Thread-safe: every bulk thread feeds it while the main loop reads it; one lock makes each
    update and each read whole (a torn average would feed a wrong ratio into ``decide``).
    """

    def __init__(self, *, alpha: float = 0.2, margin: float = DEFAULT_MARGIN, cpu_budget: float = 1.0,
                 min_samples: int = 3, decompress_Bps: float | None = None) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.margin = margin
        self.cpu_budget = cpu_budget
        self.min_samples = min_samples
        self.decompress_prior = decompress_Bps
        self.samples = 0
        self.decompress_samples = 0
        self._in = self._out = self._sec = 0.0
        self._din = self._dsec = 0.0
        self._lock = threading.Lock()

    def _ewma(self, old: float, new: float, first: bool) -> float:
        return new if first else old + self.alpha * (new - old)

    def feed(self, nbytes_in: int, nbytes_out: int, seconds: float) -> None:
        """One compressed chunk: its size, its payload's size, and the time encoding took."""
        if nbytes_in <= 0 or nbytes_out <= 0 or seconds < 0:
            raise ValueError(f"bad sample: in={nbytes_in} out={nbytes_out} seconds={seconds}")
        with self._lock:
            first = self.samples == 0
            self._in = self._ewma(self._in, float(nbytes_in), first)
            self._out = self._ewma(self._out, float(nbytes_out), first)
            self._sec = self._ewma(self._sec, max(seconds, 1e-9), first)
            self.samples += 1

    def feed_decompress(self, nbytes: int, seconds: float) -> None:
        """One decoded chunk: its uncompressed size and the time decoding took."""
        if nbytes <= 0 or seconds < 0:
            raise ValueError(f"bad sample: nbytes={nbytes} seconds={seconds}")
        with self._lock:
            first = self.decompress_samples == 0
            self._din = self._ewma(self._din, float(nbytes), first)
            self._dsec = self._ewma(self._dsec, max(seconds, 1e-9), first)
            self.decompress_samples += 1

    def snapshot(self) -> tuple[int, float | None, float | None, float | None]:
        """``(samples, ratio, compress_Bps, decompress_Bps)``, all from one consistent state."""
        ratio: float | None
        comp: float | None
        dec: float | None
        with self._lock:
            if not self.samples:
                comp = ratio = None
            else:
                ratio, comp = self._in / self._out, self._in / self._sec
            if self.decompress_samples:
                dec = self._din / self._dsec
            else:
                dec = self.decompress_prior if self.decompress_prior is not None else comp
            return self.samples, ratio, comp, dec

    @property
    def ratio(self) -> float | None:
        return self.snapshot()[1]

    @property
    def compress_Bps(self) -> float | None:
        return self.snapshot()[2]

    @property
    def decompress_Bps(self) -> float | None:
        return self.snapshot()[3]

    def goodput(self, link_Bps: float) -> float:
        """Expected goodput with compression on (uncompressed B/s); ``link_Bps`` before any sample."""
        samples, ratio, comp, dec = self.snapshot()
        if not samples:
            return link_Bps
        assert ratio is not None and comp is not None and dec is not None  # set by the first sample
        return goodput_with_compression(link_Bps, ratio, comp, dec, self.cpu_budget)

    def decide(self, link_Bps: float) -> bool:
        """Whether to compress on a link whose current bandwidth is ``link_Bps`` bytes/s."""
        samples, ratio, comp, dec = self.snapshot()
        if samples < self.min_samples:
            return False
        assert ratio is not None and comp is not None and dec is not None  # set by the first sample
        return worth_compressing(link_Bps, ratio, comp, dec, self.cpu_budget, margin=self.margin)
