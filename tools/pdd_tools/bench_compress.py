"""lz4 on real KV: ratio with and without the byte shuffle, one thread's speed, and per link rate
the goodput with and without compression and :func:`pdd_wire.compress.worth_compressing`'s answer.

    python -m pdd_tools.bench_compress [--json] [--pure] [--data DIR] [--cpu-budget N]

Input: the samples scripts/make-kv-sample wrote to tests/data/ (fp16 and bf16 KV of a tiny
random-weight Llama, described by kv_llama_tiny.json). Ratios are those of ``encode_chunk`` on
each whole sample (so never below 1: a chunk lz4 cannot shrink is sent as is). Speeds are
medians over repeated runs on one 4 MiB chunk, the sample repeated 4 times (lz4's window is
64 KiB: that chunk's ratio, in the note, is within ~1% of the sample's), with ``decode_chunk``
writing into an anonymous mmap as the agent writes into shared memory. The ``_no_l0v`` ratios
leave out layer 0's V: in a Llama, layer 0's V is a function of the token id alone, so repeated
tokens give repeated rows; with this model's 444-token vocabulary that part compresses far
better than it would with a real tokenizer, and it is 1/4 of this sample but 1/(2 x layers) of
a real model's KV.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

from pdd_wire import compress as cz

from .paths import find_up

CHUNK = 4 << 20
LINK_GBIT = (0.1, 1.0, 10.0, 25.0)
SAMPLES_ENV = "PDD_KV_SAMPLES"  # the directory of the KV samples; default: tests/data of the checkout


def default_data() -> Path:
    """``$PDD_KV_SAMPLES``, else the nearest ``tests/data`` holding the samples (:mod:`pdd_tools.paths`)."""
    if os.environ.get(SAMPLES_ENV):
        return Path(os.environ[SAMPLES_ENV])
    found = find_up(Path("tests") / "data" / "kv_llama_tiny.json")
    return found.parent if found is not None else Path("tests") / "data"


def _speed(fn, nbytes: int, reps: int) -> tuple[float, float]:
    """(median, best) bytes per second of ``fn`` over ``reps`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times), nbytes / min(times)


def ratio(data: bytes, shuffle: bool) -> float:
    return len(data) / max(1, len(cz.encode_chunk(data, shuffle=shuffle)))


def without_layer0_v(data: bytes, meta: dict) -> bytes:
    """The sample less layer 0's V (per-layer [2, blocks, block, heads, dim]: V is the 2nd half)."""
    per_layer = len(data) // meta["model"]["layers"]
    return data[: per_layer // 2] + data[per_layer:]


def speeds(data: bytes, shuffle: bool, reps: int) -> dict:
    chunk = (data * (CHUNK // len(data) + 1))[:CHUNK]
    payload = cz.encode_chunk(chunk, shuffle=shuffle)
    dst_map = mmap.mmap(-1, CHUNK)
    dst = memoryview(dst_map)
    try:
        cz.decode_chunk(payload, dst, shuffle=shuffle)
        if dst != memoryview(chunk):
            raise SystemExit("error: round trip mismatch")
        c_med, c_best = _speed(lambda: cz.encode_chunk(chunk, shuffle=shuffle), CHUNK, reps)
        d_med, d_best = _speed(lambda: cz.decode_chunk(payload, dst, shuffle=shuffle), CHUNK, reps)
    finally:
        dst.release()
        dst_map.close()
    return {"c": c_med, "c_best": c_best, "d": d_med, "d_best": d_best, "ratio_4m": CHUNK / len(payload)}


def run(data_dir: Path, reps: int, cpu_budget: float) -> list[dict]:
    meta = json.loads((data_dir / "kv_llama_tiny.json").read_text())
    fp16 = (data_dir / meta["files"]["fp16"]["file"]).read_bytes()
    bf16 = (data_dir / meta["files"]["bf16"]["file"]).read_bytes()
    m = meta["model"]
    what = (f"tiny Llama ({m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}, RANDOM weights), "
            f"{meta['tokens']} tokens of real text, {len(fp16) >> 10} KiB")
    path = "numpy" if (cz.USE_NUMPY and cz.HAVE_NUMPY) else "pure-python"
    rows: list[dict] = []

    def add(figure: str, value: float, unit: str, note: str) -> None:
        rows.append({"figure": figure, "value": round(value, 4), "unit": unit, "note": note})

    r = {}
    for name, data in (("fp16", fp16), ("bf16", bf16)):
        for sh in (True, False):
            r[name, sh] = ratio(data, sh)
            r[name, sh, "no_l0v"] = ratio(without_layer0_v(data, meta), sh)
    add("lz4_ratio_kv16", r["fp16", True], "x", f"fp16 KV, byte shuffle, lz4 default; {what}")
    add("lz4_ratio_kv16_noshuffle", r["fp16", False], "x", "fp16 KV, no shuffle")
    add("lz4_ratio_bf16", r["bf16", True], "x", "bf16 KV, byte shuffle")
    add("lz4_ratio_bf16_noshuffle", r["bf16", False], "x", "bf16 KV, no shuffle")
    add("lz4_ratio_kv16_no_l0v", r["fp16", True, "no_l0v"], "x",
        f"fp16, shuffle, without layer 0's V (token-id determined; see module doc); "
        f"no shuffle: {r['fp16', False, 'no_l0v']:.3f}")
    add("lz4_ratio_bf16_no_l0v", r["bf16", True, "no_l0v"], "x",
        f"bf16, shuffle, without layer 0's V; no shuffle: {r['bf16', False, 'no_l0v']:.3f}")

    sp = {}
    for name, data in (("fp16", fp16), ("bf16", bf16)):
        for sh in (True, False):
            sp[name, sh] = speeds(data, sh, reps)
    for name, suffix in (("fp16", ""), ("bf16", "_bf16")):
        s, s0 = sp[name, True], sp[name, False]
        add(f"lz4_compress_GBps{suffix}", s["c"] / 1e9, "GB/s",
            f"{name}, encode_chunk incl. shuffle ({path}), 1 thread, 4 MiB chunk, median of {reps} "
            f"(best {s['c_best'] / 1e9:.2f}, ratio {s['ratio_4m']:.3f}); no shuffle {s0['c'] / 1e9:.2f}")
        add(f"lz4_decompress_GBps{suffix}", s["d"] / 1e9, "GB/s",
            f"{name}, decode_chunk into mmap incl. unshuffle ({path}), 1 thread, median of {reps} "
            f"(best {s['d_best'] / 1e9:.2f}); no shuffle {s0['d'] / 1e9:.2f}")

    for gbit in LINK_GBIT:
        link = gbit * 1e9 / 8
        for name, suffix in (("fp16", ""), ("bf16", "_bf16")):
            s, s0 = sp[name, True], sp[name, False]
            g1 = cz.goodput_with_compression(link, r[name, True], s["c"], s["d"], cpu_budget)
            on = cz.worth_compressing(link, r[name, True], s["c"], s["d"], cpu_budget)
            on_deep = cz.worth_compressing(link, r[name, True, "no_l0v"], s["c"], s["d"], cpu_budget)
            g0 = cz.goodput_with_compression(link, r[name, False], s0["c"], s0["d"], cpu_budget)
            on0 = cz.worth_compressing(link, r[name, False], s0["c"], s0["d"], cpu_budget)
            note = (f"link {gbit:g} Gbit/s = {link / 1e9:.4g} GB/s; {name} shuffled: goodput "
                    f"{g1 / 1e9:.4g} GB/s with lz4 vs {link / 1e9:.4g} without -> {'ON' if on else 'off'} "
                    f"(without layer-0 V: {'ON' if on_deep else 'off'}); unshuffled lz4: gain "
                    f"{g0 / link:.3f} -> {'ON' if on0 else 'off'}; cpu_budget {cpu_budget:g}")
            add(f"lz4_goodput_gain_{gbit:g}{suffix}", g1 / link, "x", note)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdd_tools.bench_compress", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--pure", action="store_true", help="do not use numpy for the shuffle")
    ap.add_argument("--data", type=Path, default=None,
                    help=f"directory with kv_llama_tiny.json "
                    f"(default: ${SAMPLES_ENV}, else tests/data of the checkout)")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per figure")
    ap.add_argument("--cpu-budget", type=float, default=1.0, help="cores per side for (de)compression")
    a = ap.parse_args(argv)
    if a.data is None:
        a.data = default_data()
    if a.pure:
        cz.USE_NUMPY = False
    if not (a.data / "kv_llama_tiny.json").is_file():
        print(f"error: no KV sample in {a.data} (make it with scripts/make-kv-sample, or set {SAMPLES_ENV})",
              file=sys.stderr)
        return 2
    for row in run(a.data, a.reps, a.cpu_budget):
        if a.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{row['figure']:30s} {row['value']:9.3f} {row['unit']:5s}  {row['note']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
