"""Memory pressure: workers whose memory_limit is below their working set (model + KV), no KV budget.

Dask's memory manager must spill KV blocks to disk (and may pause workers); nothing may
deadlock and every workflow must give text replay's tokens. See
``daskflow_kv/bench/memory_pressure.py``.

    python benchmarks/memory_pressure.py      # SmolLM2-135M, 24 documents of 2048 tokens, 2 workers

The default limit (the model-loaded worker at half of it) leaves room for one 2,048-token
prefill below Dask's pause threshold, while the documents' KV (24 x 2,048 tokens) does not
fit: a limit under one task's own need can only end in the nanny killing the worker.

Writes benchmarks/results/memory_pressure.json (or --out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json
from daskflow_kv.bench.memory_pressure import run_memory_pressure


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--context", type=int, default=2048, help="tokens per document")
    ap.add_argument("--baseline-fraction", type=float, default=0.5,
                    help="the model-loaded worker's share of its memory_limit")
    ap.add_argument("--hang-s", type=float, default=900.0, help="the stream still running this long counts as hung")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "memory_pressure.json")
    args = ap.parse_args(argv)
    out = run_memory_pressure(args.model, workflows=args.docs, docs=args.docs, context=args.context,
                              baseline_fraction=args.baseline_fraction, hang_s=args.hang_s, log=log)
    write_json(args.out, {"command": command_line(), "machine": machine_info(), **out})
    log(f"wrote {args.out}: {out['completed']}/{out['workflows']} exact (wrong {out['wrong']}, hung {out['hung']}); "
        f"working set {out['working_set_over_limit']:.2f}x the limit, peak spilled "
        f"{out['peak_spilled_disk_bytes'] / 2**20:.0f} MiB ({out['spilled_disk_bytes_total'] / 2**20:.0f} MiB written "
        f"over the run), {out['pause_episodes']} pauses")
    return 0 if out["completed"] == out["workflows"] and not out["wrong"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
