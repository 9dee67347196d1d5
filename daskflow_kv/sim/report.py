"""Runs, metrics, the fidelity check against measured exp 7 rows, and the tables. MODELED.

``run_system`` simulates one system over one stream and returns exp 7's row fields
(``completed_per_min``: completed workflows per minute from the first arrival to the last
completion; ``latency_p95_s``: arrival to completion, exp 7's interpolated percentile;
``tokens_prefilled``). ``simulate_grid`` sweeps workers x systems x streams; ``fidelity``
replays exp 7's measured configuration at 2 workers with the fitted profile - its forwards
slowed by the cores the row's clients and scheduler took from the workers' host, where the
row recorded them (``host_load``) - and reports the relative error per system and metric.
Every row carries ``"label": "MODELED"``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..stats import percentile
from .profile import host_slowdown, router_profiles

# how a replayed ``local`` router priced, per ``--router-prices``
ROUTER_NOTE = {"as-run": "as the bench's did where that is known, else as the modeled workers",
               "fitted": "as the modeled workers", "calibration": "by its run's calibration"}
from .step_cost import bench_step_rows, row_speed
from .systems import DaskflowSystem, LocalSystem, TextSystem
from .workload import exp7_stream

LABEL = "MODELED"
SYSTEMS = {"daskflow-kv": DaskflowSystem, "local": LocalSystem, "text": TextSystem}
BENCH_NAMES = {"dkv": "daskflow-kv", "local": "local", "text": "text"}  # exp 7's system names -> ours
STREAMS = ("uniform", "zipf", "zipf-budget")
# What the fidelity check compares; ``step_busy_s``: seconds the workers spent in forward
# steps, all workers together (measured rows since 2026-12-03 record it): the work, apart
# from how it was scheduled.
METRICS = ("completed_per_min", "latency_p95_s", "tokens_prefilled", "step_busy_s")


def make_system(system: str, profile, workers: int, budget: int | None = None, **kw):
    if system == "local-no-affinity":
        return LocalSystem(profile, workers, budget, affinity=False, **kw)
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; expected one of {sorted(SYSTEMS)} or local-no-affinity")
    return SYSTEMS[system](profile, workers, budget, **kw)


def run_system(system: str, profile, workflows, workers: int, budget: int | None = None, **kw) -> dict:
    """Simulate ``system`` on ``workers`` modeled workers over ``workflows``: one MODELED row."""
    t0 = time.perf_counter()
    sim = make_system(system, profile, workers, budget, **kw)
    flows = sim.run(workflows)
    ok = [f for f in flows if not f.failed and not math.isnan(f.done_at)]
    lat = [f.done_at - f.wf.at for f in ok]
    first = min((f.wf.at for f in ok), default=math.nan)
    span = max((f.done_at for f in ok), default=math.nan) - first
    arrivals = [w.at for w in workflows]
    offered = len(workflows) / (max(arrivals) / 60.0) if max(arrivals, default=0) > 0 else math.inf
    peaks = sim.peak_kv()
    return {
        "label": LABEL, "system": system, "workers": workers, "workflows": len(workflows), "completed": len(ok),
        "failed": len(flows) - len(ok), "profile": profile.name, "kv_budget_bytes": budget,
        "offered_per_min": offered, "completed_per_min": len(ok) / span * 60.0 if span > 0 else math.nan,
        "latency_p50_s": percentile(lat, 0.5), "latency_p95_s": percentile(lat, 0.95),
        "latency_mean_s": statistics.fmean(lat) if lat else math.nan, "tokens_prefilled": sim.prefilled,
        "prompt_tokens": sum(w.prompt_tokens for w in workflows), "transfers": sim.transfers,
        "bytes_transferred": sim.bytes_transferred, "evictions": sim.evictions + sum(
            c.evicted for c in getattr(sim, "caches", ())), "peak_kv_bytes_max": max(peaks) if peaks else 0,
        "decisions": dict(getattr(sim, "decisions", {})), "events": sim.loop.events,
        "reruns": getattr(sim, "reruns", 0),  # producers Dask ran again for a block read from lineage
        "step_busy_s": sum(w.busy_time for w in sim.workers),
        "step_busy_by_worker": [w.busy_time for w in sim.workers] if workers <= 8 else None,
        "sim_wall_s": time.perf_counter() - t0,
    }


def exp7_budget(docs: int, context: int, bytes_per_token: int, workflows, fraction: float = 0.25) -> int:
    """Exp 7's per-worker budget: ``fraction`` of the documents' working set, never less than
    one workflow's KV (all its prompts and outputs, nothing shared)."""
    one = max(w.prompt_tokens + sum(c.max_new for c in w.calls) for w in workflows)
    return max(int(fraction * docs * context * bytes_per_token), one * bytes_per_token)


# -- fidelity ------------------------------------------------------------------------------------
def measured_exp7(path: str | Path, router_prices: str = "as-run") -> tuple[dict, list[dict], int | None]:
    """A bench JSON's config, its exp 7 rows and the cores of the machine it ran on; a
    ``local`` row's ``_router``: what its replay's router prices with (``router_profiles``)."""
    data = json.loads(Path(path).read_text())
    cores = (data.get("machine") or {}).get("cores")
    rows = [dict(r, _index=i) | ({"_router": router_profiles(data, r, router_prices)} if r.get("system") == "local"
                                 else {})
            for i, r in enumerate(data.get("runs", [])) if r.get("exp") == "exp7"]
    return data.get("config") or {}, rows, cores


def host_load(row: dict, cores: int | None, workers: int) -> tuple[float | None, float]:
    """The cores a measured exp 7 row's clients and scheduler kept busy on the workers' host
    (their CPU seconds over the row's wall time; rows recorded before ``cpu_s`` was: None) and
    the slowdown of the workers' forwards it implies (``profile.host_slowdown``)."""
    cpu, wall = row.get("cpu_s"), row.get("wall_s")
    if not cpu or not wall or not cores:
        return None, 1.0
    other = (cpu["client"] + (cpu.get("scheduler") or 0.0)) / wall  # None: in the client's process
    return round(other, 3), host_slowdown(int(cores), workers, other)


@dataclass(frozen=True, slots=True)
class Replay:
    """One measured exp 7 row, set up to be replayed: the same stream, workers and budget, and
    the profile it is priced with (slowed by the row's ``host_load``)."""

    row: dict  # the measured row
    system: str  # the simulator's name for its system
    stream: str
    workflows: list
    workers: int
    budget: int | None
    profile: object  # SimProfile, before ``slowed``
    slowdown: float
    other_cores: float | None
    held_out: bool  # its steps are priced by a fit on the run's other rows

    def run(self, profile=None) -> dict:
        """``run_system`` on this row (with ``profile`` in place of its own, if given)."""
        prof = self.profile if profile is None else profile
        # the rule its runtime had for blocks Dask kept only as lineage (``released_blocks``)
        kw = {"lineage": self.row.get("released_blocks") != "rebuilt"} if self.system == "daskflow-kv" else {}
        return run_system(self.system, prof.slowed(self.slowdown), self.workflows, self.workers, self.budget,
                          gate=self.row.get("workflow_gate"), **kw)  # the workflow gate it ran behind, if any


def replays(path: str | Path, profile, systems=("daskflow-kv", "local", "text"),
            router_prices: str = "as-run") -> list[Replay]:
    """Every measured exp 7 row of ``path`` of one of ``systems``, set up to be replayed. Step
    costs fitted on ``path``'s own workers are refitted for each row without that row's
    steps, so that no row is replayed on costs it fed. A ``local`` row's router prices as
    ``router_prices`` says (``profile.router_profiles``)."""
    cfg, rows, cores = measured_exp7(path, router_prices)
    # step costs fitted on this very run's workers: each row replays on a fit of the others
    held_out = bool(profile.step_costs_from) and Path(profile.step_costs_from).resolve() == Path(path).resolve()
    n, docs = int(cfg.get("exp7_workflows", 16)), int(cfg.get("exp7_docs", 4))
    context, max_new = int(cfg.get("exp7_context", 1024)), int(cfg.get("max_new_tokens", 16))
    workers = int(cfg.get("workers", 2))
    out = []
    for r in rows:
        system = BENCH_NAMES.get(r["system"], r["system"])
        if system not in systems:
            continue
        kind = r.get("stream", "uniform")  # rows before streams had kinds ran documents in turn
        wfs = exp7_stream(n, float(r["rate"]), docs, kind, context, max_new,
                          arrival_seed=int(float(r["rate"]) * 1000) + int(r.get("rep", 0)))
        other, slowdown = host_load(r, cores, workers)
        prof = profile.with_step_costs(path, skip=r["_index"]) if held_out else profile
        if r.get("_router"):  # the bench's router priced with these in the run (or a stand-in)
            prof = replace(prof, router=r["_router"])
        out.append(Replay(r, system, kind, wfs, workers, r.get("kv_budget_bytes"), prof, slowdown, other, held_out))
    return out


def fidelity(path: str | Path, profile, systems=("daskflow-kv", "local", "text"),
             router_prices: str = "as-run") -> list[dict]:
    """Every measured exp 7 row of ``path`` replayed (``replays``): the simulated and measured
    throughput, p95 latency and tokens prefilled, and the error."""
    out = []
    for case in replays(path, profile, systems, router_prices):
        r, prof = case.row, case.profile
        sim = case.run()
        steps = bench_step_rows({"runs": [r]})
        speed = row_speed(steps[0], *prof.step_costs) if steps and prof.step_costs else None
        row = {"label": LABEL, "system": case.system, "stream": case.stream, "rate": r["rate"], "rep": r.get("rep", 0),
               "workflow_gate": r.get("workflow_gate"),
               "workers": case.workers, "offered_sim": sim["offered_per_min"],
               "offered_measured": r.get("offered_per_min"), "other_cores": case.other_cores,
               "slowdown": case.slowdown, "steps_priced_held_out": case.held_out,
               # the row's measured step seconds over the modeled price of the same steps
               "step_speed": speed,
               # prompt tokens its workers fed in steps over those its workflows counted
               # (``tokens_counted``; ``tokens_prefilled`` in rows before 2026-12-06): above 1,
               # work no workflow counted (Dask's reruns from lineage, requests cancelled
               # mid-way), which the model never does
               "fed_over_counted": fed_over_counted(steps[0], r.get("tokens_counted", r.get("tokens_prefilled")))
               if steps else None,
               # how evenly the work fell: each worker's step seconds, busiest first
               "busy_by_worker": {"measured": sorted((r.get("step_busy_s") or {}).values(), reverse=True),
                                  "simulated": sorted(sim["step_busy_by_worker"] or (), reverse=True)}}
        measured = measured_totals(r)
        # A diagnostic, not the check: the same replay with its steps priced at the speed the
        # host ran during the row (measured on the row's own steps, so in-sample for speed):
        # what is left of the error is the work and its scheduling, not the host's drift.
        steady = None
        if speed:
            steady = case.run(replace(prof, step_costs=tuple(c.scaled(speed) for c in prof.step_costs)))
        for m in METRICS:
            meas, simv = measured.get(m), sim[m]
            row[m] = {"measured": meas, "simulated": simv,
                      "error": (simv - meas) / meas if meas else None}
            if steady is not None:
                row[m]["at_row_speed"] = steady[m]
                row[m]["error_at_row_speed"] = (steady[m] - meas) / meas if meas else None
        out.append(row)
    return out


def fed_over_counted(by_worker: dict[str, list[dict]], counted) -> float | None:
    """Prompt tokens a row's recorded steps fed, over the tokens its finished tasks counted."""
    fed = sum(s.get("prompt_tokens", 0) for steps in by_worker.values() for s in steps)
    return fed / counted if counted else None


def measured_totals(row: dict) -> dict:
    """A measured exp 7 row with ``step_busy_s`` summed over its workers (None: not recorded)."""
    return dict(row, step_busy_s=sum((row.get("step_busy_s") or {}).values()) or None)


def spread(values: list[float], tolerance: float) -> dict:
    """The smallest, largest, mean and mean absolute of relative errors or differences, and
    how many lie within ``tolerance``."""
    return {"min": min(values), "max": max(values), "mean": statistics.fmean(values),
            "mean_abs": statistics.fmean(abs(v) for v in values),
            "within": sum(abs(v) <= tolerance for v in values), "rows": len(values), "tolerance": tolerance}


def fidelity_summary(rows: list[dict], tolerance: float = 0.10) -> list[dict]:
    """Per system and metric: the ``spread`` of the relative errors over the replayed rows."""
    out = []
    for system in sorted({r["system"] for r in rows}):
        for m, key in [(m, "error") for m in METRICS] + [(f"{m} at the row's host speed", "error_at_row_speed")
                                                          for m in METRICS]:
            base = m.split(" ")[0]
            errs = [r[base][key] for r in rows
                    if r["system"] == system and base in r and r[base].get(key) is not None]
            if errs:
                out.append({"system": system, "metric": m} | spread(errs, tolerance))
    return out


# -- the grid ------------------------------------------------------------------------------------
def simulate_grid(profile, workers=(2, 8, 32, 128, 512), systems=("daskflow-kv", "local", "text"),
                  streams=STREAMS, per_worker: int = 20, docs_per_worker: int = 2, rate_per_worker: float = 18.0,
                  context: int = 1024, max_new: int = 16, min_workflows: int = 64, max_workflows: int = 10_240,
                  progress=None, gate: float | None = None, lineage: bool = False, seeds: int = 1) -> list[dict]:
    """Throughput and p95 per (workers, stream, system). Load scales with the cluster: exp 7's
    saturating 36/min on 2 workers (18/min per worker), ``per_worker`` workflows and
    ``docs_per_worker`` documents per worker; the budget is exp 7's rule at 2 workers (a
    fixed number of bytes per worker, so a worker holds about one document as N grows).
    ``gate``: running workflows per worker at most, for every system (``policy.workflow_gate``).
    ``lineage``: True models the rule before 2026-12-07, Dask running an evicted block's whole
    producer again when a lookup finds it in lineage; False (the runtime's rule since) rebuilds
    it by a planned prefill of what is missing, under a fresh key.
    ``seeds``: streams drawn per point (documents and arrivals); seed 0 is exp 7's own draw.
    One saturated row can move by several percent with one unplanned rerun more or less, so
    a ratio read from one draw needs its spread beside it (``ratios``)."""
    rows = []
    for n_workers in workers:
        n = min(max_workflows, max(min_workflows, per_worker * n_workers))
        docs = docs_per_worker * n_workers
        rate = rate_per_worker * n_workers
        for kind in streams:
            for seed in range(seeds):
                wfs = exp7_stream(n, rate, docs, kind, context, max_new, **_draw(seed, rate))
                budget = None
                if kind.endswith("-budget"):
                    budget = exp7_budget(2 * docs_per_worker, context, profile.bytes_per_token, wfs)
                for system in systems:
                    kw = {"lineage": lineage} if system == "daskflow-kv" else {}
                    row = run_system(system, profile, wfs, n_workers, budget, gate=gate, **kw)
                    row.update(stream=kind, docs=docs, context=context, max_new=max_new, rate_per_min=rate,
                               gate_per_worker=gate, seed=seed)
                    if kw:
                        row["lineage_reruns_modeled"] = lineage
                    rows.append(row)
                    if progress:
                        progress(row)
    return rows


def _draw(seed: int, rate_per_min: float) -> dict:
    """exp7_stream's seeds for draw ``seed``: 0 is exp 7's own (its defaults)."""
    return {} if seed == 0 else {"doc_seed": 7 + seed, "arrival_seed": int(rate_per_min * 1000) + seed}


def ratios(rows: list[dict], a: str = "daskflow-kv", b: str = "local") -> list[dict]:
    """daskflow-kv / local throughput per (workers, stream), each system on the same draw; over
    several draws (``seed``) the median, with every draw's ratio and their range."""
    idx = {(r["workers"], r["stream"], r.get("seed", 0), r["system"]): r for r in rows}
    pairs: dict = {}
    for (w, s, seed, sys_), r in sorted(idx.items()):
        if sys_ == a and (w, s, seed, b) in idx:
            o = idx[(w, s, seed, b)]
            pairs.setdefault((w, s), []).append((r["completed_per_min"] / o["completed_per_min"],
                                                 r["latency_p95_s"] / o["latency_p95_s"]))
    out = []
    for (w, s), xs in pairs.items():
        thr = [t for t, _ in xs]
        row = {"label": LABEL, "workers": w, "stream": s, "throughput_ratio": statistics.median(thr),
               "p95_ratio": statistics.median(p for _, p in xs)}
        if len(xs) > 1:
            row.update(draws=len(xs), throughput_ratios=thr, throughput_ratio_min=min(thr),
                       throughput_ratio_max=max(thr))
        out.append(row)
    return out


def _f(x, fmt="{:.1f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def markdown(result: dict) -> str:
    """``benchmarks/results/simulation.md`` from the result JSON."""
    lines = [f"# Simulation (MODELED)", "",
             f"From `{result['command']}` ({result['date']}); profile: {result['profile']['source']}. "
             "Every figure below is MODELED by `daskflow_kv/sim`, not measured.", ""]
    fid = result.get("fidelity") or []
    if fid:
        lines += ["## Fidelity at 2 workers (MODELED vs measured exp 7)", "",
                  "| system | metric | error min | error max | error mean | within ±10 % |",
                  "|---|---|---|---|---|---|"]
        for x in fidelity_summary(fid):
            lines.append(f"| {x['system']} | {x['metric']} | {100 * x['min']:+.0f} % | {100 * x['max']:+.0f} % | "
                         f"{100 * x['mean']:+.0f} % | {x['within']}/{x['rows']} |")
        held = any(r.get("steps_priced_held_out") for r in fid)
        lines += ["", "Cores busy with the clients and the scheduler (measured, over the row's wall time) slow "
                  "the modeled forwards by the slowdown shown (n/a: the row predates that record)"
                  + ("; steps are priced by what the run's Dask workers measured (the host's load is in them, "
                     "so their cost is not slowed again), each row by a fit on the run's *other* rows." if held
                     else ".")
                  + " \"Steps vs model\": the row's measured step seconds over the model's price of the same "
                    "recorded steps (rows that recorded them, with step costs): above 1 the host ran slower "
                    "during the row than the model prices, whatever work the row did. \"Fed / counted\": the "
                    "prompt tokens the row's steps fed over those its workflows counted (`tokens_counted`, or "
                    "`tokens_prefilled` in rows before 2026-12-06): above 1, work no workflow counted (Dask "
                    "running a prefill again from lineage, requests cancelled mid-way), which the model does "
                    "not do; a parallel materialize's chunks run outside the step loop and are not fed.", "",
                  "| system | stream | rep | other cores | slowdown | steps vs model | fed / counted | metric | measured "
                  "| MODELED | error |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in fid:
            for m in (m for m in METRICS if m in r):
                x = r[m]
                err = _f(None if x["error"] is None else 100 * x["error"], "{:+.0f} %")
                lines.append(f"| {r['system']} | {r['stream']} | {r['rep']} | {_f(r.get('other_cores'), '{:.2f}')} | "
                             f"{_f(r.get('slowdown'), '{:.2f}x')} | {_f(r.get('step_speed'), '{:.2f}x')} | "
                             f"{_f(r.get('fed_over_counted'), '{:.2f}')} | {m} | {_f(x['measured'])} | "
                             f"{_f(x['simulated'])} | {err} |")
        lines.append("")
    ens = result.get("ensemble")
    if ens:
        lines += [f"## The model's spread: {ens['draws']} draws a row (MODELED vs measured exp 7)", "",
                  "Each row replayed with every step's time drawn around its price, as scattered as the measured "
                  f"steps are around the same fit (a `local` row's router priced "
                  f"{ROUTER_NOTE[ens.get('router_prices', 'as-run')]}); the rows "
                  "of " + ", ".join(f"`{p}`" for p in ens["against"]) + ", each against its own run's "
                  "measurement. Error: the modeled median against the measured value.", "",
                  "| system | metric | error min | error max | error mean | within ±10 % | "
                  "measured within the draws |",
                  "|---|---|---|---|---|---|---|"]
        for x in ens["summary"]:
            rows_of = " (rows whose router priced with its run's prices)" if x.get("rows_of") == "run" else ""
            lines.append(f"| {x['system']}{rows_of} | {x['metric']} | {100 * x['min']:+.0f} % | "
                         f"{100 * x['max']:+.0f} % | "
                         f"{100 * x['mean']:+.0f} % | {x['within']}/{x['rows']} | {x['covered']}/{x['measured']} |")
        lines += ["", "| run | system | stream | rep | metric | measured | MODELED min / median / max |",
                  "|---|---|---|---|---|---|---|"]
        for r in ens["rows"]:
            for m in (m for m in METRICS if m in r):
                x = r[m]
                lines.append(f"| {r.get('run', '')} | {r['system']} | {r['stream']} | {r['rep']} | {m} | "
                             f"{_f(x['measured'])} | {_f(x['modeled_min'])} / "
                             f"{_f(x['modeled_median'])} / {_f(x['modeled_max'])} |")
        lines.append("")
    rep = result.get("repeatability")
    if rep:
        lines += ["## Measured run to run (the noise floor of the fidelity check)", "",
                  f"The same exp 7 rows measured twice (same stream seeds): `{rep['first']}` and `{rep['second']}`. "
                  "Difference: (second - first) / first.", "",
                  "| system | metric | difference min | max | mean | mean abs | within ±10 % |",
                  "|---|---|---|---|---|---|---|"]
        for x in rep["summary"]:
            lines.append(f"| {x['system']} | {x['metric']} | {100 * x['min']:+.0f} % | {100 * x['max']:+.0f} % | "
                         f"{100 * x['mean']:+.0f} % | {100 * x['mean_abs']:.0f} % | {x['within']}/{x['rows']} |")
        lines.append("")
    drawn = any(r.get("seed") for r in result["grid"])  # several draws per point: say which row is which
    lines += ["## Throughput and p95 latency vs workers (MODELED)", "",
              "| workers | stream | " + ("draw | " if drawn else "") + "system | workflows | completed/min | "
              "p95 latency s | tokens prefilled | transfers | evictions | failed |",
              "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if drawn else "")]
    for r in result["grid"]:
        lines.append(f"| {r['workers']} | {r['stream']} | " + (f"{r.get('seed', 0)} | " if drawn else "")
                     + f"{r['system']} | {r['workflows']} | "
                     f"{_f(r['completed_per_min'])} MODELED | {_f(r['latency_p95_s'])} MODELED | "
                     f"{r['tokens_prefilled']:,} | {r['transfers']} | {r['evictions']} | {r['failed']} |")
    lines += ["", "## daskflow-kv / local (MODELED)", "", "| workers | stream | throughput ratio | p95 ratio |",
              "|---|---|---|---|"]
    for r in result["ratios"]:
        spread = (f" [{r['throughput_ratio_min']:.2f}-{r['throughput_ratio_max']:.2f}x over {r['draws']} draws]"
                  if r.get("draws") else "")
        lines.append(f"| {r['workers']} | {r['stream']} | {_f(r['throughput_ratio'], '{:.2f}x')}{spread} MODELED | "
                     f"{_f(r['p95_ratio'], '{:.2f}x')} MODELED |")
    sp = result.get("speed")
    if sp:
        lines += ["", f"Speed: {sp['workers']} workers x {sp['workflows']:,} workflows ({sp['system']}, "
                  f"{sp['stream']}) simulated in {sp['wall_s']:.1f} s on one core (target 60 s)."]
    return "\n".join(lines) + "\n"
