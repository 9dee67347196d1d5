"""How far apart calibrations of the same cluster land: one probe per length vs several rounds.

Each trial starts a fresh cluster as the bench does (``cfg`` workers, one thread each), loads
the model and calibrates once with ``rounds`` rounds of prefill probes. Every worker's probe
timings are then fitted twice from the scheduler's event log: on the first round alone (what
a calibration of one probe per length gives a fresh worker) and on all rounds (what the
runtime's default fits). The figures: each fit's predicted seconds for a few prefill shapes,
and their spread (max / min) over every (trial, worker) - one host, one model, so an
ideal calibration would give the same prices every time.

    python -m daskflow_kv.bench.calibration_spread --trials 6 \\
        --out benchmarks/results/calibration_repeats.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .. import validation
from .common import machine_info, write_json
from ..policy.cost_model import PrefillProfile, PrefillSample, calibration_lengths, fit_prefill_profile

SHAPES = ((1024, 0), (64, 1024), (32, 0))  # (new tokens, cached prefix): a document, a continuation, a short prompt


def fits(samples: list[PrefillSample], per_round: int) -> dict[str, PrefillProfile]:
    """The profile fitted on the first round of probes alone and on every round."""
    return {"first_round": fit_prefill_profile(samples[:per_round]), "all_rounds": fit_prefill_profile(samples)}


def spread(rows: list[dict], shapes=SHAPES) -> dict:
    """Per fit and shape: the predicted seconds' min, max and max/min over ``rows`` (each
    row: {fit name: [a, b, c]})."""
    out = {}
    for name in ("first_round", "all_rounds"):
        for n, p in shapes:
            v = [PrefillProfile(*r[name]).seconds(n, p) for r in rows]
            out[f"{name} {n}+{p}"] = {"min_s": min(v), "max_s": max(v), "spread": max(v) / min(v)}
    return out


def trial(model: str, dtype: str, workers: int, probe_tokens: int, rounds: int) -> list[dict]:
    from distributed import Client

    from ..keys import PREFILL_TOPIC
    from ..runtime.cluster import local_cluster
    from ..runtime.kv_runtime import KVRuntime

    with local_cluster(workers, 1, memory_limit="8GiB", dashboard_address=None) as c, Client(c) as client:
        rt = KVRuntime(client, model, dtype=dtype)
        t0 = time.time()
        rt.calibrate(probe_tokens=probe_tokens, probe_repeats=rounds)  # waits for every probe's timing
        took = time.time() - t0
        per: dict[str, list[PrefillSample]] = {}
        for _, e in client.get_events(PREFILL_TOPIC):
            if isinstance(e, dict) and e.get("op") == "calibrate":
                per.setdefault(e["worker"], []).append(PrefillSample(e["new_tokens"], e["prefix_tokens"], e["seconds"]))
    n = len(calibration_lengths(probe_tokens))
    return [{"worker": i, "calibration_s": took, "seconds": [s.seconds for s in ss],
             **{k: [f.a, f.b, f.c] for k, f in fits(ss, n).items()}}
            for i, ss in enumerate(per.values())]


def main(argv=None) -> int:
    ap = validation.ArgumentParser(prog="python -m daskflow_kv.bench.calibration_spread",
                                   description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--probe-tokens", type=int, default=1024)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.trials < 1 or a.rounds < 2 or a.workers < 1:
        ap.error("--trials and --workers must be >= 1 and --rounds >= 2 (the first round is compared with all)")
    rows = []
    for t in range(a.trials):
        for r in trial(a.model, a.dtype, a.workers, a.probe_tokens, a.rounds):
            rows.append({"trial": t, **r})
            print(json.dumps({k: rows[-1][k] for k in ("trial", "worker", "first_round", "all_rounds")}), flush=True)
    doc = {"command": "python -m daskflow_kv.bench.calibration_spread " + " ".join(sys.argv[1:] if argv is None else argv),
           "config": vars(a) | {"out": str(a.out)}, "machine": machine_info(), "rows": rows, "spread": spread(rows)}
    write_json(a.out, doc)
    for k, v in doc["spread"].items():
        print(f"{k:>24}: {v['min_s']:.3f}-{v['max_s']:.3f} s, spread {v['spread']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
