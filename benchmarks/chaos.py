"""Chaos during a stream: worker processes SIGKILLed while two clients stream workflows.

A local cluster of 3 worker processes under nannies (a killed worker restarts, empty), the
tiny offline model, two clients each running RAG and debate workflows over shared
documents 4 at a time; a random worker is SIGKILLed every 5-40 s. Every workflow's tokens
are checked against text replay of the same workflow (run before any kill); a workflow not
done ``--hang-s`` after it started counts as hung. See ``daskflow_kv/bench/chaos.py``.

    python benchmarks/chaos.py                                  # 2 x 30 workflows
    python benchmarks/chaos.py --workflows 6 --kill-every 3 6 --max-kills 2

Writes benchmarks/results/chaos.json (or --out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from daskflow_kv.bench.chaos import ChaosConfig, run_chaos
from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--workflows", type=int, default=30, help="per client")
    ap.add_argument("--kill-every", type=float, nargs=2, default=(5.0, 40.0), metavar=("MIN_S", "MAX_S"))
    ap.add_argument("--max-kills", type=int, default=None)
    ap.add_argument("--hang-s", type=float, default=180.0)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "chaos.json")
    args = ap.parse_args(argv)

    import dask
    from distributed import Client

    from daskflow_kv.runtime.cluster import local_cluster
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    cfg = ChaosConfig(workflows=args.workflows, kill_every=tuple(args.kill_every), max_kills=args.max_kills,
                      hang_s=args.hang_s)
    with local_cluster(args.workers, 1, dashboard_address=None) as cluster, \
            Client(cluster) as c0, Client(cluster, set_as_default=False) as c1:
        runtimes = [KVRuntime(c, args.model, block_size=16) for c in (c0, c1)]
        out = run_chaos(cluster, [c0, c1], runtimes, cfg, log=log)
    # The budget and the gate come from Dask's config (DASK_DASKFLOW_KV__KV_BUDGET=256KiB ...): say which ran.
    settings = {k: dask.config.get(f"daskflow-kv.{k}", None) for k in ("kv-budget", "scheduler.workflow-gate")}
    doc = {"command": command_line(), "machine": machine_info(), "model": args.model, "workers": args.workers,
           "settings": settings, **out}
    write_json(args.out, doc)
    log(f"wrote {args.out}: {out['completed']}/{out['workflows']} completed, {out['wrong']} wrong, "
        f"{out['lost']} lost, {out['hung']} hung, {len(out['kills'])} kills")
    return 0 if out["completed"] == out["workflows"] and not out["wrong"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
