"""A client process SIGKILLed mid-stream while it holds live KV states.

The scheduler must end its sessions, release the states it registered and leave the blocks
it pinned to the cache (evictable), while the other client's workflows go on unaffected
(each checked against text replay). See ``daskflow_kv/bench/client_lost.py``.

    python benchmarks/client_lost.py

Writes benchmarks/results/client_lost.json (or --out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from daskflow_kv.bench.client_lost import run_client_lost
from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workflows", type=int, default=12, help="the surviving client's")
    ap.add_argument("--kill-after", type=float, default=4.0, help="seconds into the survivor's stream")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "client_lost.json")
    args = ap.parse_args(argv)

    from distributed import Client

    from daskflow_kv.runtime.cluster import local_cluster
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    with local_cluster(2, 1, dashboard_address=None) as cluster, Client(cluster) as client:
        rt = KVRuntime(client, "tiny-llama", block_size=16)
        out = run_client_lost(cluster.scheduler_address, client, rt, args.workflows, args.kill_after, log=log)
    write_json(args.out, {"command": command_line(), "machine": machine_info(), "model": "tiny-llama", **out})
    log(f"wrote {args.out}: victim cleaned within {out['cleaned_within_s']} s; survivor "
        f"{out['survivor_agree']}/{out['survivor_workflows']} exact")
    ok = out["cleaned_within_s"] is not None and out["survivor_agree"] == out["survivor_workflows"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
