"""The scheduler SIGKILLed mid-stream; a new cluster over the same persistent store resumes.

Every call in flight and every next call must fail within 30 s with an error naming the lost
scheduler; the new cluster must prefill no token of a context the store already held; every
workflow's tokens must equal text replay's. See ``daskflow_kv/bench/scheduler_lost.py``.

    python benchmarks/scheduler_lost.py                # SmolLM2-135M, 8 workflows over 2 documents

Writes benchmarks/results/scheduler_lost.json (or --out).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json
from daskflow_kv.bench.scheduler_lost import run_scheduler_lost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--workflows", type=int, default=8)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--context", type=int, default=512, help="tokens per shared document")
    ap.add_argument("--kill-after", type=int, default=3, help="workflows finished before the kill")
    ap.add_argument("--store", default=None, help="the persistent store (default: a fresh temporary directory)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "scheduler_lost.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kv-store-") as tmp:
        out = run_scheduler_lost(args.store or tmp, args.model, args.workflows, args.docs, args.context,
                                 kill_after_done=args.kill_after, log=log)
    write_json(args.out, {"command": command_line(), "machine": machine_info(), **out})
    log(f"wrote {args.out}: failures within 30 s {out['failures_within_30s']}; lost {out['lost']}, wrong "
        f"{out['wrong']}; stored context tokens prefilled again {out['stored_tokens_prefilled_again']} "
        f"({out['context_tokens_from_store']} read from the store)")
    ok = out["failures_within_30s"] and not out["lost"] and not out["wrong"] and not out["stored_tokens_prefilled_again"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
