"""``daskflow-kv bench``: every system, every experiment, one invocation, one cluster.

    daskflow-kv bench --quick                        # tiny-llama, every experiment, a few minutes
    daskflow-kv bench --profile full --warm --reps 3 # the published run: SmolLM2-135M, cold and warm
    daskflow-kv bench --profile full --experiments 3 --netem-rates 1000 100   # one experiment

Experiments: 1 TTFT vs context, 2 wall time vs agents k (4 memory and 5 overhead come from
2's runs), 3 transfer vs recompute (loopback, then real tc rate limits incl. near-tie rates),
6 multi-round workflows, 7 a stream of workflows at several arrival rates. ``--warm`` runs
exp 1 and 2 again with the shared context left cached by an earlier workflow.

Writes under ``--out`` (default benchmarks/results/): bench_<tag>.json (everything, with the
machine and the exact command), bench_<tag>_runs.csv (one row per run), bench_<tag>_summary.csv
(medians per point and system), bench_<tag>_exp3.csv, bench_<tag>_exp*.png (needs matplotlib)
and SUMMARY.md (full profile) or SUMMARY_<tag>.md. Exit status 3 if some system's outputs
differed from text replay's (their speeds are not reported).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from .. import config, validation
from ..errors import InvalidInputError

PROFILES = {
    # CI smoke test: seconds of compute; k = 4 on 2 workers reaches the batched path
    "smoke": {"model": "tiny-llama", "contexts": [128, 256], "agents": 4, "exp2_context": 128, "ks": [1, 4],
              "reps": 1, "max_new_tokens": 4, "exp3_contexts": [128, 512], "netem_jobs": [], "near_tie": [], "near_tie_contexts": [], "systems": ["text", "hf", "local", "dkv"], "probe_mib": 4, "warmup": False,
              "exp6_workflows": ["debate"], "exp6_context": 96, "exp7_rates": [600], "exp7_workflows": 4,
              "exp7_docs": 2, "exp7_context": 96, "exp7_streams": ["uniform", "zipf-budget"],
              "exp7_budget_fraction": 0.25,
              "parallel_contexts": [128, 256], "parallel_exp1_contexts": [256]},
    # a few minutes on 2 cores: tiny-llama, every experiment at small sizes
    "quick": {"model": "tiny-llama", "contexts": [256, 512, 1024, 1900], "agents": 4, "exp2_context": 512,
              "ks": [1, 2, 4, 8, 16], "reps": 1, "max_new_tokens": 8, "exp3_contexts": [256, 1024, 1900],
              "netem_jobs": [[50, [256, 1900]], [2, [256]]], "near_tie": [0.85, 1.2], "near_tie_contexts": [1024],
              "systems": ["text", "hf", "local", "dkv"], "exp6_workflows": ["debate", "planner"],
              "exp6_context": 512, "exp7_rates": [60, 600], "exp7_workflows": 8, "exp7_docs": 4, "exp7_context": 256,
              "exp7_streams": ["uniform", "zipf", "zipf-budget"], "exp7_budget_fraction": 0.25,
              "parallel_contexts": [256, 1024, 1900], "parallel_exp1_contexts": [1024, 1900]},
    # the published measurement: SmolLM2-135M (46,080 KV bytes per token in fp32). With --warm
    # --reps 3 on 2 quiet cores, estimated from earlier SmolLM2 runs: setup 1 min, exp3 loopback 2,
    # exp1 20, exp2 12, exp6 6, exp7 7, exp3 under tc 8: about 55 min of work, ~70 min in all.
    "full": {"model": "smollm2", "contexts": [512, 1024, 2048, 4096], "agents": 4, "exp2_context": 1024,
             "ks": [1, 4, 16], "reps": 3, "max_new_tokens": 16, "exp3_contexts": [512, 1024, 2048, 4096],
             "netem_jobs": [[1000, [512, 1024, 2048, 4096]], [300, [512, 1024, 2048]], [50, [512, 1024]]],
             "near_tie": [0.85, 1.2], "near_tie_contexts": [512, 1024, 2048],
             "systems": ["text", "hf", "local", "dkv"], "exp6_workflows": ["debate", "planner"],
             "exp6_context": 2048, "exp7_rates": [12, 60], "exp7_workflows": 16, "exp7_docs": 8,
             "exp7_context": 1024, "exp7_streams": ["uniform", "zipf", "zipf-budget"], "exp7_budget_fraction": 0.25,
             "parallel_contexts": [1024, 2048, 4096, 8192], "parallel_exp1_contexts": [4096, 8192]},
}
EXP7_AGENT_TOKENS = 512  # room an exp 7 agent needs past its document: task, upstream outputs, answer
MODELED_BANDWIDTHS_GBPS = [100, 25, 10, 3, 1, 0.3, 0.1, 0.03, 0.01]
# systems.SYSTEMS + systems.OPTIONAL_SYSTEMS (tests check), here so flags are checked without torch
ALL_SYSTEMS = ("text", "hf", "local", "dkv", "dkv-transfer", "dkv-recompute")


EXPERIMENTS = (1, 2, 3, 4, 5, 6, 7, 8)


def _parser() -> argparse.ArgumentParser:
    ap = validation.ArgumentParser(prog="daskflow-kv bench", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--quick", dest="profile", action="store_const", const="quick", help="same as --profile quick")
    ap.add_argument("--model", help="tiny-llama | tiny-qwen2 | smollm2 | a path | emulated:<profile> (profile default)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--experiments", default="1,2,3,4,5,6,7,8",
                    help="comma list of 1-8 (4 and 5 come from 2's runs; 8: parallel materialize)")
    ap.add_argument("--systems", help="comma list of text,hf,local,dkv,dkv-transfer,dkv-recompute")
    ap.add_argument("--warm", action="store_true", help="exp 1 and 2 also warm: the shared context already cached")
    ap.add_argument("--contexts", type=int, nargs="+", help="exp1 context lengths (prompt tokens)")
    ap.add_argument("--agents", type=int, help="exp1 agents")
    ap.add_argument("--exp2-context", type=int, help="exp2 context length")
    ap.add_argument("--ks", type=int, nargs="+", help="exp2 agent counts")
    ap.add_argument("--reps", type=int, help="repetitions per point (medians reported)")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--exp3-contexts", type=int, nargs="+")
    ap.add_argument("--netem-rates", type=float, nargs="*", help="Mbit/s for the throttled exp3 (needs root)")
    ap.add_argument("--netem-contexts", type=int, nargs="*")
    ap.add_argument("--near-tie", type=float, nargs="*",
                    help="extra exp3 rates at these multiples of each context's measured tie rate")
    ap.add_argument("--no-netem", action="store_true", help="skip real throttling (exp3 MODELED rows stay)")
    ap.add_argument("--exp6-context", type=int, help="exp6 shared context (tokens)")
    ap.add_argument("--exp7-rates", type=float, nargs="+", help="exp7 arrival rates, workflows per minute")
    ap.add_argument("--exp7-workflows", type=int, help="exp7 workflows per stream")
    ap.add_argument("--exp7-docs", type=int, help="exp7 shared documents the stream draws from")
    ap.add_argument("--exp7-context", type=int, help="exp7 document length (tokens)")
    ap.add_argument("--exp7-gates", nargs="+", metavar="N|none", type=_gate,
                    help="exp7 workflow gates, running workflows per worker (none: no gate); every system runs "
                         "once per gate, side by side (default: none)")
    ap.add_argument("--exp7-streams", nargs="+", choices=["uniform", "zipf", "zipf-budget"],
                    help="exp7 stream kinds (documents in turn, Zipf-drawn, Zipf under a KV budget)")
    ap.add_argument("--parallel-contexts", type=int, nargs="+", help="exp8 materialize context lengths")
    ap.add_argument("--parallel-widths", type=int, nargs="+", default=[1, 2], help="exp8 worker counts W")
    ap.add_argument("--parallel-exp1-contexts", type=int, nargs="+", help="exp8 cold exp1 context lengths")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--memory-limit", default="8GiB", help="per worker")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--tag", default=None, help="file name tag (default: the profile)")
    ap.add_argument("--summary", default=None, help="markdown summary path")
    ap.add_argument("--readme", default=None,
                    help="rewrite the bench blocks of this README and of benchmarks/README.md beside it from the "
                         "run (bench:headline and bench:results markers; see readme_blocks)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _gate(text: str) -> float | str | None:
    """``--exp7-gates`` values: none, or a number (checked with the rest in ``check``)."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return float(text)
    except ValueError:
        return text  # refused by ``check``, with the flag's name


def resolve(args) -> dict:
    cfg = dict(PROFILES[args.profile])
    for key in ("model", "contexts", "agents", "exp2_context", "ks", "reps", "max_new_tokens", "exp3_contexts",
                "near_tie", "exp6_context", "exp7_rates", "exp7_workflows", "exp7_docs", "exp7_context", "exp7_streams",
                "exp7_gates",
                "parallel_contexts",
                "parallel_exp1_contexts"):
        v = getattr(args, key)
        if v is not None:
            cfg[key] = v
    if args.netem_rates is not None or args.netem_contexts is not None:
        rates = args.netem_rates if args.netem_rates is not None else sorted({r for r, _ in cfg["netem_jobs"]})
        ctxs = args.netem_contexts if args.netem_contexts is not None else \
            sorted({c for _, cs in cfg["netem_jobs"] for c in cs})
        cfg["netem_jobs"] = [[r, list(ctxs)] for r in rates]
        if args.netem_contexts is not None:
            cfg["near_tie_contexts"] = list(args.netem_contexts)
    if args.systems is not None:
        cfg["systems"] = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.no_netem:
        cfg["netem_jobs"], cfg["near_tie"] = [], []
    cfg["experiments"] = [x.strip() for x in args.experiments.split(",") if x.strip()]
    cfg["dtype"] = args.dtype
    cfg["workers"] = args.workers
    cfg["profile"] = args.profile
    cfg["phases"] = ["cold", "warm"] if args.warm else ["cold"]
    cfg["parallel_widths"] = args.parallel_widths
    return check(cfg)


def check(cfg: dict) -> dict:
    """Every knob of a bench run, checked (and normalized) before a cluster starts."""
    from ..model.zoo.names import check_model, max_positions

    v = validation
    most = v.integer("setting daskflow-kv.max-fork", config.get("max-fork"), minimum=1)
    cfg["model"] = check_model(cfg["model"], "--model")
    cfg["dtype"] = v.dtype("--dtype", cfg["dtype"])
    exps = set()
    for x in cfg["experiments"]:
        if not x.isdigit() or int(x) not in EXPERIMENTS:
            raise InvalidInputError(f"--experiments must be a comma list of 1-8, got {x!r}")
        exps.add(int(x))
    if not exps:
        raise InvalidInputError("--experiments must name at least one of 1-8")
    cfg["experiments"] = sorted(exps)
    if not cfg["systems"]:
        raise InvalidInputError(f"--systems must name at least one of {', '.join(ALL_SYSTEMS)}")
    for name in cfg["systems"]:
        v.choice("--systems", name, ALL_SYSTEMS)
    cfg["agents"] = v.integer("--agents", cfg["agents"], minimum=1, maximum=most)
    cfg["exp2_context"] = v.integer("--exp2-context", cfg["exp2_context"], minimum=1)
    cfg["reps"] = v.integer("--reps", cfg["reps"], minimum=1)
    cfg["max_new_tokens"] = v.max_new_tokens("--max-new-tokens", cfg["max_new_tokens"])
    cfg["workers"] = v.integer("--workers", cfg["workers"], minimum=1)
    for key, flag in (("contexts", "--contexts"), ("exp3_contexts", "--exp3-contexts"),
                      ("near_tie_contexts", "--netem-contexts"), ("parallel_contexts", "--parallel-contexts"),
                      ("parallel_exp1_contexts", "--parallel-exp1-contexts")):
        cfg[key] = [v.integer(flag, c, minimum=1) for c in cfg.get(key, [])]
    cfg["parallel_widths"] = [v.integer("--parallel-widths", w, minimum=1) for w in cfg.get("parallel_widths", [1, 2])]
    cfg["netem_jobs"] = [[v.number("--netem-rates", r, above=0), [v.integer("--netem-contexts", c, minimum=1)
                                                                  for c in cs]] for r, cs in cfg["netem_jobs"]]
    cfg["near_tie"] = [v.number("--near-tie", f, above=0) for f in cfg["near_tie"]]
    cfg["ks"] = [v.integer("--ks", k, minimum=1, maximum=most) for k in cfg["ks"]]
    cfg["exp6_context"] = v.integer("--exp6-context", cfg["exp6_context"], minimum=1)
    cfg["exp7_rates"] = [v.number("--exp7-rates", r, above=0) for r in cfg["exp7_rates"]]
    cfg["exp7_workflows"] = v.integer("--exp7-workflows", cfg["exp7_workflows"], minimum=1)
    cfg["exp7_docs"] = v.integer("--exp7-docs", cfg.get("exp7_docs", 2), minimum=1)
    cfg["exp7_context"] = v.integer("--exp7-context", cfg.get("exp7_context", 96), minimum=1)
    room = max_positions(cfg["model"])  # an agent's prompt and answer follow the document
    if 7 in exps and room is not None and cfg["exp7_context"] + EXP7_AGENT_TOKENS > room:
        raise InvalidInputError(f"--exp7-context {cfg['exp7_context']} leaves too little room in {cfg['model']}'s "
                                f"{room} positions: give at most {room - EXP7_AGENT_TOKENS}")
    cfg["exp7_gates"] = [None if g is None else v.number("--exp7-gates", g, above=0)
                         for g in cfg.get("exp7_gates") or [None]]
    if 3 in exps and cfg["workers"] < 2:
        raise InvalidInputError("experiment 3 moves KV between two workers: --workers must be >= 2 with it")
    if 8 in exps and max(cfg["parallel_widths"]) > cfg["workers"]:
        raise InvalidInputError(f"--parallel-widths asks for {max(cfg['parallel_widths'])} workers; --workers is "
                                f"{cfg['workers']}")
    return cfg


def warm_up_systems(b, systems, max_new) -> None:
    """One tiny run of every system: model code paths, connections and kernels warmed."""
    from . import systems as S
    from .workload import build_workload

    wl = build_workload(b.rt.tokenizer, 96, min(len(b.workers), 2) * 2, min(max_new, 2), f"warmup-{time.time()}",
                        b.rt.facts.max_positions)
    for name in systems:
        S.measured_run(b, name, wl, sample_memory=False)
        S.reset_caches(b)


def run(cfg: dict, out_dir: Path, tag: str, command: str, plots: bool = True, progress: bool = True,
        summary_path: Path | None = None, memory_limit: str = "8GiB", readme: Path | None = None,
        simulate_exp7=None) -> dict:
    from distributed import Client

    from ..runtime.cluster import local_cluster
    from .common import log, machine_info
    from .report import write_all

    logging.getLogger("daskflow_kv.scheduler").setLevel(logging.ERROR)  # drains log "over budget"
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # "sequence longer than max length" while cutting documents
    except ImportError:
        pass
    t_start = time.time()
    doc: dict = {"command": command, "config": cfg, "machine": machine_info(), "tag": tag, "runs": []}
    exps = cfg["experiments"]
    systems = cfg["systems"]
    log(f"daskflow-kv bench [{cfg['profile']}] model {cfg['model']} systems {','.join(systems)} experiments {exps}")
    try:
        with local_cluster(cfg["workers"], 1, memory_limit=memory_limit, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            _cluster_part(cfg, doc, client, out_dir, tag, progress)
        if 3 in exps and (cfg["netem_jobs"] or cfg["near_tie"]):
            _throttled_part(cfg, doc, memory_limit)
        elif 3 in exps:
            doc["netem"] = {"error": "not run (no rates given or --no-netem)"}
    except BaseException as e:  # keep what was measured; Ctrl-C included
        doc["error"] = f"{type(e).__name__}: {e}"
        log(f"bench stopped early: {doc['error']}; writing what was measured")
        if config.get("verbose"):
            log(traceback.format_exc())
        if not isinstance(e, Exception):
            raise
    finally:
        doc["total_s"] = time.time() - t_start
        files = write_all(doc, out_dir, tag, plots=plots, summary_path=summary_path, simulate_exp7=simulate_exp7)
        if doc.get("parallel"):
            from .exp_parallel import write as write_parallel

            files += write_parallel(doc, out_dir, tag, summary_path or out_dir / f"SUMMARY_{tag}.md")
        doc["files"] = [str(f) for f in files]
        log("wrote:\n  " + "\n  ".join(str(f) for f in files))
        if readme is not None and "error" not in doc:
            from .readme_blocks import update_readmes

            for line in update_readmes(readme, doc, doc["summary"], out_dir / f"bench_{tag}.json",
                                       summary_path or out_dir / f"SUMMARY_{tag}.md", readme_blocks_of(cfg)):
                log(line)
    return doc


def _throttled_part(cfg: dict, doc: dict, memory_limit: str) -> None:
    """Exp 3 under real rate limits: the profile's jobs, then near-tie rates per context."""
    from .common import log
    from .experiments import near_tie_rates
    from .netem import run_throttled

    jobs = [(r, cs) for r, cs in cfg["netem_jobs"]]
    loop = [r for r in doc.get("exp3", []) if r.get("label") == "loopback"]
    ties = near_tie_rates(loop, cfg["near_tie_contexts"], cfg["near_tie"]) if cfg["near_tie"] else []
    jobs += ties
    doc["netem_jobs"] = jobs
    log(f"exp3 under real rate limits: {len(jobs)} jobs ({len(ties)} at near-tie rates): "
        + ", ".join(f"{r:g} Mbit/s {cs}" for r, cs in jobs))
    t0 = time.time()
    net = run_throttled(cfg["model"], jobs, cfg["dtype"], memory_limit=memory_limit)
    doc["exp3"] = doc.get("exp3", []) + net.get("rows", [])
    doc["netem"] = {"error": net.get("error"), "jobs": jobs, "seconds": time.time() - t0}
    if net.get("error"):
        log(f"  throttled exp3 incomplete: {net['error']} (MODELED rows only for the missing points)")


def readme_blocks_of(cfg: dict):
    """The README blocks a run rewrites (``readme_blocks.update_readmes``' ``only``): all for a
    run of every experiment; the headline alone for a run of some, whose table would replace
    the full run's results block with a part of it."""
    from .readme_blocks import HEADLINE_MARKERS

    return None if set(cfg["experiments"]) >= set(EXPERIMENTS) else HEADLINE_MARKERS


def calibration_tokens(cfg: dict, contexts: list[int]) -> int:
    """The longest prefill to calibrate on: every experiment's context, so the planner and the
    ``local`` router price the lengths they will predict (an exp 7 run once probed up to 256
    tokens for 1,024-token documents, and its router's extrapolated prices were off by up to
    2x: docs/simulation.md)."""
    exps = set(cfg["experiments"])
    return max([*(contexts if 1 in exps else []), cfg["exp2_context"] if {2, 4, 5} & exps else 0,
                *(cfg["exp3_contexts"] if 3 in exps else []), cfg["exp6_context"] if 6 in exps else 0,
                cfg["exp7_context"] if 7 in exps else 0, 256])


def _cluster_part(cfg: dict, doc: dict, client, out_dir: Path, tag: str, progress: bool) -> None:
    """Experiments 1-7 on the local cluster (exp 3's throttled part runs elsewhere)."""
    from ..runtime.kv_runtime import KVRuntime
    from . import experiments as E
    from . import provenance
    from . import systems as S
    from .common import Progress, log, write_json

    t_start = time.time()
    exps, systems, phases = cfg["experiments"], cfg["systems"], cfg["phases"]
    rt = KVRuntime(client, cfg["model"], dtype=cfg["dtype"])
    workers = S.workers_of(client)
    doc["lease_shortened"] = S.shorten_lease(client)
    max_pos = rt.facts.max_positions
    doc["model"] = {"name": cfg["model"], "model_id": rt.fingerprint.model_id, "dtype": cfg["dtype"],
                    "bytes_per_token": rt.facts.bytes_per_token, "max_positions": max_pos}
    emulated = emulated_label(cfg["model"], doc)
    log(f"cluster up, model loaded in {time.time() - t_start:.1f}s")
    t0 = time.time()
    limit = max_pos - cfg["max_new_tokens"] - 8
    contexts = sorted({min(c, limit) for c in cfg["contexts"]})
    longest = calibration_tokens(cfg, contexts)
    doc["calibration"] = rt.calibrate(probe_bytes=cfg.get("probe_mib", 32) << 20,
                                      probe_tokens=min(longest, max_pos - 16))
    b = S.make_bench(rt, workers)
    if cfg.get("warmup", True):
        warm_up_systems(b, systems, cfg["max_new_tokens"])
    log(f"cluster of {len(workers)} workers ready; calibrated and warmed up in {time.time() - t0:.1f}s")
    per_point = sum(len(systems) - (p == "warm" and "text" in systems) for p in phases)
    n_steps = cfg["reps"] * per_point * ((len(contexts) if 1 in exps else 0)
                                         + (len(cfg["ks"]) if {2, 4, 5} & set(exps) else 0))
    n_steps += len(cfg["exp3_contexts"]) if 3 in exps else 0
    flows = [s for s in systems if s in ("text", "local", "dkv")]  # exp 6 and 7 run these
    n_steps += cfg["reps"] * len(cfg["exp6_workflows"]) * len(flows) if 6 in exps else 0
    exp7_flows = [s for s in flows if s != "text"]  # text replay runs once per stream kind
    n_steps += len(cfg["exp7_streams"]) * (1 + cfg["reps"] * len(cfg["exp7_rates"]) * len(exp7_flows)
                                           * len(cfg["exp7_gates"])) if 7 in exps else 0
    if 8 in exps:
        n_steps += cfg["reps"] * (len(cfg["parallel_contexts"]) * len(cfg["parallel_widths"])
                                  + 5 * len(cfg["parallel_exp1_contexts"]))
    bar = Progress(n_steps, "bench", progress)
    partial = out_dir / f"bench_{tag}.json"
    doc["timing"] = {}

    def step(name, fn):
        t = time.time()
        fn()
        doc["timing"][name] = time.time() - t
        provenance.tag_rows(doc["runs"])  # rows pooled with another run's are told apart
        for r in doc["runs"] if emulated else ():  # every row of an emulated engine says so
            r.setdefault("emulated", emulated)
        write_json(partial, doc)

    try:
        if 3 in exps:  # first: the prefill profile is then fitted on the calibration and exp 3's own prefills
            def exp3():
                e3 = sorted({min(c, max_pos - 16) for c in cfg["exp3_contexts"]})
                fresh = doc["calibration"] if max(e3) <= longest else None  # taken just now, over these lengths
                doc["exp3"] = E.exp3_loopback(rt, e3, workers, 1, bar, probe_bytes=cfg.get("probe_mib", 32) << 20,
                                              calibration=fresh)
                doc["exp3_modeled"] = E.modeled_sweep(rt, e3, MODELED_BANDWIDTHS_GBPS, workers[1])
            step("exp3", exp3)
        if 1 in exps:
            step("exp1", lambda: doc["runs"].extend(E.exp1(b, contexts, cfg["agents"], cfg["max_new_tokens"], systems,
                                                           cfg["reps"], phases, bar)))
        if {2, 4, 5} & set(exps):
            step("exp2", lambda: doc["runs"].extend(E.exp2(b, min(cfg["exp2_context"], limit), cfg["ks"],
                                                           cfg["max_new_tokens"], systems, cfg["reps"], phases, bar)))
        if 6 in exps:
            from .multiround import exp6

            S.refresh_router(b)
            step("exp6", lambda: doc["runs"].extend(exp6(b, cfg["exp6_workflows"], cfg["exp6_context"],
                                                         cfg["max_new_tokens"], systems, cfg["reps"], bar)))
        if 7 in exps:
            from .load import exp7

            S.refresh_router(b)
            step("exp7", lambda: doc["runs"].extend(exp7(b, cfg["exp7_rates"], cfg["exp7_workflows"],
                                                         cfg["exp7_docs"], cfg["exp7_context"],
                                                         cfg["max_new_tokens"], systems, cfg["reps"],
                                                         cfg["exp7_streams"], cfg["exp7_budget_fraction"],
                                                         gates=cfg["exp7_gates"], progress=bar)))
        if 8 in exps:  # parallel materialize: W workers prefill one context together
            from .exp_parallel import run as run_parallel

            step("exp8", lambda: doc.__setitem__("parallel", run_parallel(rt, cfg, workers, bar)))
    finally:
        bar.close()
        doc["counters"] = rt.counters()["counters"]
        # The profiles the planner ended on, refitted from the run's own prefills (the last
        # ``scheduler.prefill-samples`` per worker): what the simulation fits (``sim.profile``).
        doc["prefill_profiles_end"] = {w: {"a": p.a, "b": p.b, "c": p.c} for w, p in rt.view().prefill.items()}


def emulated_label(model: str, doc: dict) -> str | None:
    """For ``emulated:<profile>``: the profile's record in ``doc["model"]["emulated"]`` and its
    label (EMULATED, its name, what it stands in for); None for a real model."""
    from ..model.emulated_profile import is_emulated, load_profile

    if not is_emulated(model):
        return None
    profile = load_profile(model)
    doc["model"]["emulated"] = profile.describe()
    doc["model"]["dtype"] = profile.dtype  # its K/V's, whatever --dtype said
    return profile.label


def main(argv=None, simulate_exp7=None) -> int:
    """Exit status: 0 ok, 2 bad flags (one line on stderr), 3 some system's outputs differed.
    ``simulate_exp7``: ``sim.beside.simulate``, which ``daskflow-kv bench`` hands in (the
    simulator sits above the bench): each exp 7 row is printed and kept beside its simulation."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = _parser().parse_args(argv)
    try:
        cfg = resolve(args)
        validation.byte_size("--memory-limit", args.memory_limit)
        from .common import RESULTS_DIR, command_line, summary_file

        out_dir = validation.writable_dir("--out", args.out) if args.out else RESULTS_DIR
        tag = args.tag or cfg["profile"]
        if not tag or os.sep in tag or tag in (".", ".."):
            raise InvalidInputError(f"--tag must be a plain file-name part, got {tag!r}")
        summary = Path(validation.writable_file("--summary", args.summary)) if args.summary else \
            summary_file(out_dir, tag)
        readme = Path(validation.writable_file("--readme", args.readme)) if args.readme else None
        if readme is not None:
            from .readme_blocks import readme_files

            readme_files(readme)  # some bench block to rewrite, checked before the run
    except InvalidInputError as e:
        print(f"daskflow-kv bench: error: {e}", file=sys.stderr)
        return 2
    prog = "daskflow-kv bench" if argv is not None or "daskflow-kv" in sys.argv[0] else "python -m daskflow_kv.bench"
    doc = run(cfg, out_dir, tag, command_line(prog, argv), plots=not args.no_plots, progress=not args.no_progress,
              summary_path=summary, memory_limit=args.memory_limit, readme=readme, simulate_exp7=simulate_exp7)
    mismatched = sorted({r["system"] for r in doc.get("runs", []) if r.get("agree") is False})
    if mismatched:
        print(f"outputs differed from text replay for: {', '.join(mismatched)} (speeds not reported)")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
