"""``daskflow-kv simulate``: the MODELED grid, the fidelity check, one run, or a trace replay.

    daskflow-kv simulate                                  # grid + fidelity -> benchmarks/results/simulation.*
    daskflow-kv simulate --hardware h200-nvlink --workers 8 32 --streams zipf-budget
    daskflow-kv simulate --trace my.jsonl --workers 16 --systems daskflow-kv local
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

from ..bench import provenance
from . import ensemble, repeatability
from .plot import plot_ratios
from .profile import PRESETS, ROUTER_PRICES, fitted_profile, preset_profile
from .report import (STREAMS, fidelity, fidelity_summary, markdown, measured_exp7, ratios, run_system,
                     simulate_grid)
from .workload import exp7_stream, read_trace

BENCH = "benchmarks/results/bench_full.json"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="daskflow-kv simulate", description=__doc__.splitlines()[0])
    p.add_argument("--profile-from", default=BENCH, help="bench results JSON whose calibration is fitted (default %(default)s)")
    p.add_argument("--step-cost", help="price whole steps by this benchmarks/step_cost.py results JSON "
                                       "(default: the profile's prefill and decode terms added up)")
    p.add_argument("--hardware", choices=sorted(PRESETS), help="a MODELED hardware preset instead of the fitted profile")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 8, 32, 128, 512])
    p.add_argument("--systems", nargs="+", default=["daskflow-kv", "local", "text"])
    p.add_argument("--streams", nargs="+", default=list(STREAMS), choices=STREAMS)
    p.add_argument("--per-worker", type=int, default=20, help="workflows per worker (capped at 10,240)")
    p.add_argument("--rate-per-worker", type=float, default=18.0,
                   help="workflows/min offered per worker (default %(default)s: exp 7's 36/min on 2 workers)")
    p.add_argument("--context", type=int, default=1024, metavar="TOKENS",
                   help="each document's tokens in the grid's streams (default %(default)s: exp 7's); the budget "
                        "scales with it, so a worker still holds about one document")
    p.add_argument("--max-new", type=int, default=16, metavar="TOKENS",
                   help="tokens each agent decodes in the grid's streams (default %(default)s: exp 7's)")
    p.add_argument("--workflow-gate", type=float, metavar="N",
                   help="the workflow gate (daskflow-kv.scheduler.workflow-gate): at most N running workflows per "
                        "worker, the rest wait in line, for every system (default: none)")
    p.add_argument("--lineage-reruns", action="store_true",
                   help="model the runtime before 2026-12-07: a lookup finds an evicted block in Dask's lineage and "
                        "Dask runs the block's whole producer again, instead of a planned prefill of the missing "
                        "tokens under a fresh key (the runtime's rule since; the default models it)")
    p.add_argument("--seeds", type=int, default=1, metavar="K",
                   help="draw each grid point's stream K times (documents and arrivals; the first is exp 7's own) "
                        "and give each ratio as the median with its range (default %(default)s)")
    p.add_argument("--trace", help="replay a JSON-lines trace (see daskflow_kv/sim/workload.py) instead of exp 7")
    p.add_argument("--budget", type=int, help="KV bytes per worker for --trace runs (default: none)")
    p.add_argument("--no-fidelity", action="store_true", help="skip the comparison with measured exp 7 rows")
    p.add_argument("--repeat-of", metavar="BENCH_JSON",
                   help="a second measurement of the same exp 7 rows (same config and seeds): report how far the "
                        "two lie apart, the noise floor of the per-row fidelity check")
    p.add_argument("--draws", type=int, default=0, metavar="K",
                   help="also replay each measured exp 7 row K times, every step's time drawn around its price as "
                        "scattered as the measured steps (needs --step-cost from a bench JSON): the model's spread "
                        "beside the measured one (default: no draws)")
    p.add_argument("--draws-against", nargs="+", default=[], metavar="BENCH_JSON",
                   help="more bench JSONs with exp 7 rows, drawn too and held against their own measurements (each "
                        "run's streams and host load; its `local` router's prices as --router-prices says)")
    p.add_argument("--router-prices", choices=ROUTER_PRICES, default="as-run",
                   help="what a replayed `local` row's router prices with: as the bench's router did where the run "
                        "says (default), the modeled workers' fitted profiles, or each run's calibration")
    p.add_argument("--speed", action="store_true", help="also time 512 workers x 10,000 workflows (daskflow-kv)")
    p.add_argument("--out", default="benchmarks/results/simulation",
                   help="output stem: .json, .md and (several worker counts) .png (default %(default)s)")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:  # a missing or unreadable input file: one line, before any simulation runs
        profile = preset_profile(args.hardware) if args.hardware else fitted_profile(args.profile_from)
        if args.step_cost:
            profile = profile.with_step_costs(args.step_cost)
        wfs = read_trace(args.trace) if args.trace else None
        repeat = repeatability.compare(args.profile_from, args.repeat_of) if args.repeat_of else None
        for other in args.draws_against:  # each replayed as it ran: it needs exp 7 rows, or is refused here
            if not measured_exp7(other)[1]:
                raise ValueError(f"{other} has no exp 7 rows to hold draws against")
    except (OSError, ValueError, KeyError) as e:  # JSONDecodeError is a ValueError
        parser.error(" ".join(str(e).split()))
    if args.draws and (args.draws < 2 or not profile.step_scatter):
        parser.error(f"--draws {args.draws}: give 2 or more, with --step-cost from a bench JSON whose exp 7 rows "
                     "recorded their steps (the scatter the draws take)")
    if args.draws_against and not args.draws:
        parser.error("--draws-against needs --draws")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: give 1 or more draws per grid point")
    for flag, value in (("--context", args.context), ("--max-new", args.max_new)):
        if value < 1:
            parser.error(f"{flag} {value}: give 1 or more tokens")
    if args.workflow_gate is not None and not 0 < args.workflow_gate < math.inf:
        parser.error(f"--workflow-gate {args.workflow_gate}: give running workflows per worker, more than 0")
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.trace:
        lineage = {"lineage": args.lineage_reruns}
        rows = [run_system(s, profile, wfs, n, args.budget, **(lineage if s == "daskflow-kv" else {}))
                | {"stream": f"trace:{Path(args.trace).name}"} for n in args.workers for s in args.systems]
        for r in rows:
            say(f"{r['workers']:>4} workers {r['system']:<12} {r['completed_per_min']:.1f}/min MODELED, "
                f"p95 {r['latency_p95_s']:.1f} s MODELED")
        print(json.dumps(rows, indent=1, default=str))
        return 0
    t0 = time.perf_counter()
    grid = simulate_grid(profile, args.workers, args.systems, args.streams, per_worker=args.per_worker,
                         rate_per_worker=args.rate_per_worker, context=args.context, max_new=args.max_new,
                         gate=args.workflow_gate,
                         lineage=args.lineage_reruns, seeds=args.seeds,
                         progress=lambda r: say(f"{r['workers']:>4} workers {r['stream']:<12} "
                                                + (f"draw {r['seed']} " if r.get("seed") else "") + f"{r['system']:<12} "
                                                f"{r['completed_per_min']:8.1f}/min p95 {r['latency_p95_s']:7.1f} s "
                                                f"MODELED ({r['sim_wall_s']:.1f} s)"))
    result = {"label": "MODELED", "command": "daskflow-kv simulate " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.date.today().isoformat(),
              "profile": {"name": profile.name, "source": profile.source, "bytes_per_token": profile.bytes_per_token},
              "grid": grid, "ratios": ratios(grid)}
    if not args.no_fidelity and not args.hardware and Path(args.profile_from).exists():
        result["fidelity"] = fidelity(args.profile_from, profile, router_prices=args.router_prices)
        result["fidelity_summary"] = fidelity_summary(result["fidelity"])
    if args.draws and not args.no_fidelity:
        rows = ensemble.replay([args.profile_from, *args.draws_against], profile, args.draws, args.systems,
                               args.router_prices)
        result["ensemble"] = {"draws": args.draws, "against": [args.profile_from, *args.draws_against],
                              "router_prices": args.router_prices,
                              "rows": rows, "summary": ensemble.summary(rows)}
    if repeat is not None:
        result["repeatability"] = {"first": args.profile_from, "second": args.repeat_of, "rows": repeat,
                                   "summary": repeatability.summary(repeat)}
    if args.speed:
        wfs = exp7_stream(10_000, 18.0 * 512, 1024, "zipf")
        from .report import exp7_budget
        r = run_system("daskflow-kv", profile, wfs, 512, exp7_budget(4, 1024, profile.bytes_per_token, wfs))
        result["speed"] = {"label": "MODELED", "workers": 512, "workflows": 10_000, "system": "daskflow-kv",
                           "stream": "zipf-budget", "wall_s": r["sim_wall_s"], "target_s": 60.0}
    result["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(provenance.stamp(result), indent=1, default=lambda x: None if isinstance(x, float)
                                                   and math.isnan(x) else str(x)) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    png = plot_ratios(result, out.with_suffix(".png")) if len(args.workers) > 1 else None
    say(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}{' and ' + str(png) if png else ''} "
        f"in {result['wall_s']:.0f} s")
    return 0
