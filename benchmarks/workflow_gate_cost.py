"""What passing the workflow gate costs a run: entering and leaving its line, with no limit
and with places free (two scheduler calls; no run waits here, so this is the gate's own price).

    python benchmarks/workflow_gate_cost.py            # 300 runs per setting, ~20 s

Writes benchmarks/results/workflow_gate_cost.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json


def main(argv=None) -> int:
    from distributed import Client

    from daskflow_kv.runtime.cluster import local_cluster
    from daskflow_kv.runtime.kv_runtime import KVRuntime
    from daskflow_kv.runtime.workflow_gate import admitted

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.runs < 20:
        ap.error(f"--runs must be at least 20, got {args.runs}")
    doc = {"command": command_line("python benchmarks/workflow_gate_cost.py", argv), "machine": machine_info(),
           "settings": []}
    with local_cluster(2, 1, dashboard_address=None) as cluster, Client(cluster) as client:
        rt = KVRuntime(client, "tiny-llama")
        for limit in (None, 4):
            rt.set_workflow_gate(limit)
            seconds = []
            for i in range(args.runs):
                t0 = time.perf_counter()
                with admitted(rt.plugin, f"cost-{limit}-{i}"):
                    pass
                seconds.append(time.perf_counter() - t0)
            s = sorted(seconds)
            row = {"per_worker": limit, "runs": args.runs, "median_s": statistics.median(s),
                   "p95_s": s[int(0.95 * len(s))], "max_s": s[-1]}
            doc["settings"].append(row)
            log(f"gate {limit}: enter + leave median {row['median_s'] * 1e3:.2f} ms, p95 {row['p95_s'] * 1e3:.2f} ms")
        rt.set_workflow_gate(None)
    out = Path(args.out) if args.out else RESULTS_DIR / "workflow_gate_cost.json"
    write_json(out, doc)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
