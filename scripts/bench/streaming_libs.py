#!/usr/bin/env python
"""LitData vs mosaicml-streaming on the same items: write N JPEG-sized byte items into shards
of one library's own format (local folder), then read one shuffled epoch of them back through
that library's StreamingDataset and a torch DataLoader (num_workers 0 and 2, no decoding).

Run it once with each library's interpreter (mosaicml-streaming pins numpy < 2.2, so it lives
in a venv of its own):
    python scripts/bench/streaming_libs.py --lib litdata
    /path/to/mds-venv/bin/python scripts/bench/streaming_libs.py --lib mds
Prints one JSON line: write seconds, shard bytes, samples/s per worker count (median of rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

# This folder holds scripts/bench/streaming.py, which would shadow mosaicml's `streaming`.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def items(n: int, size: int):
    rng = __import__("random").Random(0)
    for i in range(n):
        yield i, rng.randbytes(size), i % 10


def write_litdata(out: str, n: int, size: int) -> None:
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(out, chunk_bytes="4MB")
    for i, data, label in items(n, size):
        writer[i] = {"index": i, "image": data, "label": label}
    writer.done()
    writer.merge()


def write_mds(out: str, n: int, size: int) -> None:
    from streaming import MDSWriter

    columns = {"index": "int", "image": "bytes", "label": "int"}
    with MDSWriter(out=out, columns=columns, size_limit="4mb") as w:
        for i, data, label in items(n, size):
            w.write({"index": i, "image": data, "label": label})


def read_epoch(lib: str, path: str, workers: int, cache: str) -> float:
    from torch.utils.data import DataLoader

    if lib == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(path, shuffle=True, seed=0)
        loader = StreamingDataLoader(ds, batch_size=256, num_workers=workers)
    else:
        from streaming import StreamingDataset

        ds = StreamingDataset(
            local=cache, remote=path, shuffle=True, shuffle_seed=0, batch_size=256
        )
        loader = DataLoader(ds, batch_size=256, num_workers=workers)
    t0 = time.perf_counter()
    n = sum(len(b["index"]) for b in loader)
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lib", choices=("litdata", "mds"), required=True)
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--size", type=int, default=3000, help="bytes per item (a small JPEG)")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix=f"libs_{a.lib}_")
    try:
        out = os.path.join(work, "shards")
        t0 = time.perf_counter()
        (write_litdata if a.lib == "litdata" else write_mds)(out, a.n, a.size)
        write_s = time.perf_counter() - t0
        nbytes = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        speeds = {}
        for workers in (0, 2):
            runs = []
            for r in range(a.rounds):
                cache = os.path.join(work, f"cache_{workers}_{r}")
                runs.append(read_epoch(a.lib, out, workers, cache))
            speeds[workers] = statistics.median(runs)
        import numpy

        print(
            json.dumps(
                {
                    "lib": a.lib,
                    "numpy": numpy.__version__,
                    "write_s": round(write_s, 2),
                    "shard_mb": round(nbytes / 1e6, 1),
                    "samples_per_s": {k: round(v) for k, v in speeds.items()},
                }
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
