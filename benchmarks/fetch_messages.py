"""A peer fetch of KV-sized blocks in one message (Dask's way) and one key a message (daskflow-kv's).

Workers ask their peers for one key a message (``dask_internals.gather_one_key_per_message``)
so that a peer holding blocks on its spill disk loads one at a time to send them, not a whole
document past its KV budget. The price is a round trip a block: this times a task on worker
b reading ``--blocks`` blocks held on worker a, in memory there, on two 2-worker clusters
side by side (Dask's default, and one key a message), reps alternated.

    python benchmarks/fetch_messages.py --blocks 8 64 --block-mib 2.8 --reps 5

(2.8 MiB: a 64-token SmolLM2 block in fp32; 8 blocks are a 512-token document, 64 a 4,096-token one.)
Writes benchmarks/results/fetch_messages.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from distributed import Client, LocalCluster, wait

from daskflow_kv import dask_internals as di
from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json

WAYS = ("one message", "one key a message")


def _one_key_a_message(dask_worker=None) -> None:
    di.gather_one_key_per_message(dask_worker)


def fetch_s(client: Client, blocks: int, block_bytes: int, tag: str) -> float:
    """Seconds for a task on the second worker to receive ``blocks`` blocks held on the first."""
    a, b = sorted(client.scheduler_info()["workers"])
    xs = [client.submit(np.ones, block_bytes // 8, key=f"fetch-{tag}-{i}", workers=[a], pure=False)
          for i in range(blocks)]
    wait(xs)
    t0 = time.perf_counter()
    assert client.submit(lambda *vs: len(vs), *xs, workers=[b], pure=False).result() == blocks
    return time.perf_counter() - t0


def run(args) -> dict:
    cluster = dict(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    with LocalCluster(**cluster) as c1, Client(c1) as dask_way, LocalCluster(**cluster) as c2, Client(c2) as ours:
        ours.run(_one_key_a_message)
        clients = dict(zip(WAYS, (dask_way, ours)))
        rows = []
        for blocks in args.blocks:
            times = {w: [] for w in WAYS}
            for rep in range(args.reps):
                for way in (WAYS if rep % 2 == 0 else WAYS[::-1]):
                    times[way].append(fetch_s(clients[way], blocks, int(args.block_mib * 2**20), f"{blocks}-{rep}"))
            med = {w: statistics.median(v) for w, v in times.items()}
            rows.append({"blocks": blocks, "block_mib": args.block_mib, "seconds": times,
                         "median_s": med, "ratio": med[WAYS[1]] / med[WAYS[0]]})
            log(f"{blocks} blocks: one message {med[WAYS[0]] * 1e3:.1f} ms, one key a message "
                f"{med[WAYS[1]] * 1e3:.1f} ms ({rows[-1]['ratio']:.2f}x)")
    return {"command": command_line(), "machine": machine_info(), "reps": args.reps, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--block-mib", type=float, default=2.8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else RESULTS_DIR / "fetch_messages.json"
    write_json(out, run(args))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
