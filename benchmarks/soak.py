"""A soak: two clients stream workflows for half an hour under a KV budget that forces evictions.

Every run must agree with its text replay, none lost or hung; scheduler, worker and client
memory, catalog, buffers, sessions, leases and store writes in flight must level off after
warm-up (at most +10 % to the end); once the clients close, no KV key may be left that
nothing retains on purpose. See ``daskflow_kv/bench/soak.py``.

    python benchmarks/soak.py                 # 30 minutes, tiny model, 2 workers
    python benchmarks/soak.py --minutes 5     # a shorter one

Writes benchmarks/results/soak.json (or --out).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json
from daskflow_kv.bench.soak import GROWTH_LIMIT, IN_FLIGHT, SoakConfig, run_soak


WORKERS = 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=4, help="workflows in flight per client")
    ap.add_argument("--warmup-minutes", type=float, default=5.0)
    ap.add_argument("--hang-s", type=float, default=300.0,
                    help="a workflow still running this long after the stream's end counts as hung")
    ap.add_argument("--budget-workflows", type=float, default=None,
                    help="KV budget per worker in workflows' KV (default: room for what is in flight)")
    ap.add_argument("--scheduler-in-process", action="store_true",
                    help="the scheduler in this process, with the clients (its memory then not told apart)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json")
    args = ap.parse_args(argv)

    from daskflow_kv.bench import cluster_process
    from daskflow_kv.runtime.cluster import local_cluster

    cfg = SoakConfig(minutes=args.minutes, concurrency=args.concurrency, warmup_minutes=args.warmup_minutes,
                     hang_s=args.hang_s, budget_workflows=args.budget_workflows)
    with tempfile.TemporaryDirectory(prefix="kv-store-") as store:
        if args.scheduler_in_process:
            with local_cluster(WORKERS, 1, dashboard_address=None) as cluster:
                out = run_soak(cluster, WORKERS, cfg, store, log=log)
        else:  # as deployed: the scheduler's process is not the clients'
            proc, address = cluster_process.start(WORKERS, log)
            try:
                out = run_soak(address, WORKERS, cfg, store, log=log)
            finally:
                cluster_process.end(proc)
    out["scheduler_in_process"] = args.scheduler_in_process
    write_json(args.out, {"command": command_line(), "machine": machine_info(), **out})
    ends = {k: v for k, v in out["growth_after_warmup"].items() if v is not None and k not in IN_FLIGHT}
    worst = max(ends.items(), key=lambda kv: kv[1], default=("-", 0.0))
    log(f"wrote {args.out}: {out['completed']}/{out['workflows']} workflows exact in {out['wall_s'] / 60:.1f} min, "
        f"{out['lost']} lost; largest growth after warm-up {worst[0]} {worst[1]:+.1%} (limit {GROWTH_LIMIT:+.0%}), "
        f"levels off: {out['growth_ok']}; keys left {out['keys_left_after_clients_closed']}")
    ok = out["completed"] == out["workflows"] and not out["wrong"] and out["growth_ok"] \
        and not out["keys_left_after_clients_closed"]["wanted_by_no_one"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
