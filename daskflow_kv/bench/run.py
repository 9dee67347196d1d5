"""``daskflow-kv bench``: every system, every experiment, one invocation, one cluster.

    daskflow-kv bench --quick                 # tiny-llama, a few minutes on 2 cores (CI smoke)
    daskflow-kv bench --profile full          # SmolLM2-135M, all five experiments
    daskflow-kv bench --profile full --experiments 3 --netem-rates 1000 100   # one experiment
    daskflow-kv bench --profile full --experiments 6   # parallel materialize: W=1 vs 2, cold exp1 with it

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
from pathlib import Path

from .. import config, validation
from ..errors import InvalidInputError

PROFILES = {
    # CI smoke test: seconds of compute, checks the whole pipeline end to end
    "smoke": {"model": "tiny-llama", "contexts": [128, 256], "agents": 2, "exp2_context": 128, "ks": [1, 2],
              "reps": 1, "max_new_tokens": 4, "exp3_contexts": [128, 512], "netem_rates": [], "netem_contexts": [],
              "systems": ["text", "hf", "local", "dkv"], "probe_mib": 4, "warmup": False,
              "parallel_contexts": [128, 256], "parallel_exp1_contexts": [256]},
    # a few minutes on 2 cores: tiny-llama, every experiment at small sizes
    "quick": {"model": "tiny-llama", "contexts": [256, 512, 1024, 1900], "agents": 4, "exp2_context": 512,
              "ks": [1, 2, 4, 8, 16], "reps": 1, "max_new_tokens": 8, "exp3_contexts": [256, 1024, 1900],
              "netem_rates": [50, 2], "netem_contexts": [256, 1900], "systems": ["text", "hf", "local", "dkv"],
              "parallel_contexts": [256, 1024, 1900], "parallel_exp1_contexts": [1024, 1900]},
    # the real measurement: SmolLM2-135M (46,080 KV bytes per token in fp32); ~40 min on 2 quiet cores
    "full": {"model": "smollm2", "contexts": [512, 1024, 2048, 4096, 8192], "agents": 4, "exp2_context": 2048,
             "ks": [1, 2, 4, 8, 16], "reps": 2, "max_new_tokens": 16, "exp3_contexts": [512, 1024, 2048, 4096],
             "netem_rates": [2000, 500, 150, 50], "netem_contexts": [512, 1024, 2048],
             "systems": ["text", "hf", "local", "dkv"],
             "parallel_contexts": [1024, 2048, 4096, 8192], "parallel_exp1_contexts": [4096, 8192]},
}
MODELED_BANDWIDTHS_GBPS = [100, 25, 10, 3, 1, 0.3, 0.1, 0.03, 0.01]
# systems.SYSTEMS + systems.OPTIONAL_SYSTEMS (tests check), here so flags are checked without torch
ALL_SYSTEMS = ("text", "hf", "local", "dkv", "dkv-transfer", "dkv-recompute")


def _parser() -> argparse.ArgumentParser:
    ap = validation.ArgumentParser(prog="daskflow-kv bench", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--quick", dest="profile", action="store_const", const="quick", help="same as --profile quick")
    ap.add_argument("--model", help="tiny-llama | tiny-qwen2 | smollm2 | a path (profile default)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--experiments", default="1,2,3,4,5",
                    help="comma list of 1-6 (4 and 5 come from 2's runs; 6: parallel materialize)")
    ap.add_argument("--systems", help="comma list of text,hf,local,dkv,dkv-transfer,dkv-recompute")
    ap.add_argument("--contexts", type=int, nargs="+", help="exp1 context lengths (prompt tokens)")
    ap.add_argument("--agents", type=int, help="exp1 agents")
    ap.add_argument("--exp2-context", type=int, help="exp2 context length")
    ap.add_argument("--ks", type=int, nargs="+", help="exp2 agent counts")
    ap.add_argument("--reps", type=int, help="repetitions per point (medians reported)")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--exp3-contexts", type=int, nargs="+")
    ap.add_argument("--netem-rates", type=float, nargs="*", help="Mbit/s for the throttled exp3 (needs root)")
    ap.add_argument("--netem-contexts", type=int, nargs="*")
    ap.add_argument("--no-netem", action="store_true", help="skip real throttling (exp3 MODELED rows stay)")
    ap.add_argument("--parallel-contexts", type=int, nargs="+", help="exp6 materialize context lengths")
    ap.add_argument("--parallel-widths", type=int, nargs="+", default=[1, 2], help="exp6 worker counts W")
    ap.add_argument("--parallel-exp1-contexts", type=int, nargs="+", help="exp6 cold exp1 context lengths")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--memory-limit", default="8GiB", help="per worker")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--tag", default=None, help="file name tag (default: the profile)")
    ap.add_argument("--summary", default=None, help="markdown summary path")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def resolve(args) -> dict:
    cfg = dict(PROFILES[args.profile])
    for key in ("model", "contexts", "agents", "exp2_context", "ks", "reps", "max_new_tokens", "exp3_contexts",
                "netem_rates", "netem_contexts", "parallel_contexts", "parallel_exp1_contexts"):
        v = getattr(args, key)
        if v is not None:
            cfg[key] = v
    if args.systems is not None:
        cfg["systems"] = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.no_netem:
        cfg["netem_rates"] = []
    cfg["experiments"] = [x.strip() for x in args.experiments.split(",") if x.strip()]
    cfg["dtype"] = args.dtype
    cfg["workers"] = args.workers
    cfg["parallel_widths"] = args.parallel_widths
    cfg["profile"] = args.profile
    return check(cfg)


def check(cfg: dict) -> dict:
    """Every knob of a bench run, checked (and normalized) before a cluster starts."""
    from ..model.zoo.names import check_model

    v = validation
    most = v.integer("setting daskflow-kv.max-fork", config.get("max-fork"), minimum=1)
    cfg["model"] = check_model(cfg["model"], "--model")
    cfg["dtype"] = v.dtype("--dtype", cfg["dtype"])
    exps = set()
    for x in cfg["experiments"]:
        if not x.isdigit() or not 1 <= int(x) <= 6:
            raise InvalidInputError(f"--experiments must be a comma list of 1-6, got {x!r}")
        exps.add(int(x))
    if not exps:
        raise InvalidInputError("--experiments must name at least one of 1-6")
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
                      ("netem_contexts", "--netem-contexts"), ("parallel_contexts", "--parallel-contexts"),
                      ("parallel_exp1_contexts", "--parallel-exp1-contexts")):
        cfg[key] = [v.integer(flag, c, minimum=1) for c in cfg.get(key, [])]
    cfg["parallel_widths"] = [v.integer("--parallel-widths", w, minimum=1) for w in cfg.get("parallel_widths", [1, 2])]
    cfg["ks"] = [v.integer("--ks", k, minimum=1, maximum=most) for k in cfg["ks"]]
    cfg["netem_rates"] = [v.number("--netem-rates", r, above=0) for r in cfg["netem_rates"]]
    if 3 in exps and cfg["workers"] < 2:
        raise InvalidInputError("experiment 3 moves KV between two workers: --workers must be >= 2 with it")
    if 6 in exps and max(cfg["parallel_widths"]) > cfg["workers"]:
        raise InvalidInputError(f"--parallel-widths asks for {max(cfg['parallel_widths'])} workers; --workers is "
                                f"{cfg['workers']}")
    return cfg


def _warm_up(rt, systems, workers, max_new) -> None:
    from . import systems as S
    from .workload import build_workload

    wl = build_workload(rt.tokenizer, 96, min(len(workers), 2), min(max_new, 2), f"warmup-{time.time()}",
                        rt.facts.max_positions)
    for name in systems:
        S.measured_run(rt, name, wl, workers, sample_memory=False)
        S.drain_kv(rt, timeout=10)


def run(cfg: dict, out_dir: Path, tag: str, command: str, plots: bool = True, progress: bool = True,
        summary_path: Path | None = None, memory_limit: str = "8GiB") -> dict:
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
        if 3 in exps and cfg["netem_rates"]:
            from .netem import run_throttled

            log(f"exp3 under real rate limits: {cfg['netem_rates']} Mbit/s, contexts {cfg['netem_contexts']}")
            net = run_throttled(cfg["model"], list(cfg["netem_rates"]), list(cfg["netem_contexts"]), cfg["dtype"],
                                memory_limit=memory_limit)
            doc["exp3"] = doc.get("exp3", []) + net.get("rows", [])
            doc["netem"] = {"error": net.get("error"), "rates_mbit": cfg["netem_rates"]}
            if net.get("error"):
                log(f"  throttled exp3 incomplete: {net['error']} (MODELED rows only for the missing points)")
        elif 3 in exps:
            doc["netem"] = {"error": "not run (no rates given or --no-netem)"}
    except BaseException as e:  # keep what was measured; Ctrl-C included
        doc["error"] = f"{type(e).__name__}: {e}"
        log(f"bench stopped early: {doc['error']}; writing what was measured")
        if not isinstance(e, Exception):
            raise
    finally:
        doc["total_s"] = time.time() - t_start
        files = write_all(doc, out_dir, tag, plots=plots, summary_path=summary_path)
        from .exp_parallel import write as write_parallel

        files += write_parallel(doc, out_dir, tag, summary_path or out_dir / f"SUMMARY_{tag}.md")
        doc["files"] = [str(f) for f in files]
        log("wrote:\n  " + "\n  ".join(str(f) for f in files))
    return doc


def _cluster_part(cfg: dict, doc: dict, client, out_dir: Path, tag: str, progress: bool) -> None:
    """Experiments 1-5 on the local cluster (exp 3's throttled part runs elsewhere)."""
    from ..runtime.kv_runtime import KVRuntime
    from . import experiments as E
    from . import systems as S
    from .common import Progress, log, write_json

    t_start = time.time()
    exps, systems = cfg["experiments"], cfg["systems"]
    rt = KVRuntime(client, cfg["model"], dtype=cfg["dtype"])
    workers = S.workers_of(client)
    doc["lease_shortened"] = S.shorten_lease(client)
    client.get_task_stream()  # start recording task timings
    max_pos = rt.facts.max_positions
    doc["model"] = {"name": cfg["model"], "model_id": rt.fingerprint.model_id, "dtype": cfg["dtype"],
                    "bytes_per_token": rt.facts.bytes_per_token, "max_positions": max_pos}
    log(f"cluster up, model loaded in {time.time() - t_start:.1f}s")
    t0 = time.time()
    doc["calibration"] = rt.calibrate(probe_bytes=cfg.get("probe_mib", 32) << 20)
    if cfg.get("warmup", True):
        _warm_up(rt, systems, workers, cfg["max_new_tokens"])
    log(f"cluster of {len(workers)} workers ready; calibrated and warmed up in {time.time() - t0:.1f}s")
    limit = max_pos - cfg["max_new_tokens"] - 8
    contexts = sorted({min(c, limit) for c in cfg["contexts"]})
    n_runs = len(systems) * cfg["reps"] * ((len(contexts) if 1 in exps else 0)
                                           + (len(cfg["ks"]) if {2, 4, 5} & set(exps) else 0))
    if 6 in exps:
        n_runs += cfg["reps"] * (len(cfg["parallel_contexts"]) * len(cfg["parallel_widths"])
                                 + 5 * len(cfg["parallel_exp1_contexts"]))
    bar = Progress(n_runs + (len(cfg["exp3_contexts"]) if 3 in exps else 0), "bench", progress)
    partial = out_dir / f"bench_{tag}.json"
    try:
        if 1 in exps:
            doc["runs"] += E.exp1(rt, contexts, cfg["agents"], cfg["max_new_tokens"], systems, workers, cfg["reps"],
                                  bar)
            write_json(partial, doc)
        if {2, 4, 5} & set(exps):
            doc["runs"] += E.exp2(rt, min(cfg["exp2_context"], limit), cfg["ks"], cfg["max_new_tokens"], systems,
                                  workers, cfg["reps"], bar)
            write_json(partial, doc)
        if 3 in exps:
            e3 = sorted({min(c, max_pos - 16) for c in cfg["exp3_contexts"]})
            doc["exp3"] = E.exp3_loopback(rt, e3, workers, 1, bar, probe_bytes=cfg.get("probe_mib", 32) << 20)
            doc["exp3_modeled"] = E.modeled_sweep(rt, e3, MODELED_BANDWIDTHS_GBPS, workers[1])
            write_json(partial, doc)
        if 6 in exps:
            from .exp_parallel import run as run_parallel

            doc["parallel"] = run_parallel(rt, cfg, workers, bar)
            write_json(partial, doc)
    finally:
        bar.close()
        doc["counters"] = rt.counters()["counters"]


def main(argv=None) -> int:
    """Exit status: 0 ok, 2 bad flags (one line on stderr), 3 some system's outputs differed."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = _parser().parse_args(argv)
    try:
        cfg = resolve(args)
        validation.byte_size("--memory-limit", args.memory_limit)
        from .common import RESULTS_DIR, command_line

        out_dir = validation.writable_dir("--out", args.out) if args.out else RESULTS_DIR
        tag = args.tag or cfg["profile"]
        if not tag or os.sep in tag or tag in (".", ".."):
            raise InvalidInputError(f"--tag must be a plain file-name part, got {tag!r}")
        summary = Path(validation.writable_file("--summary", args.summary)) if args.summary else \
            out_dir / ("SUMMARY.md" if tag == "full" else f"SUMMARY_{tag}.md")
    except InvalidInputError as e:
        print(f"daskflow-kv bench: error: {e}", file=sys.stderr)
        return 2
    prog = "daskflow-kv bench" if argv is not None or "daskflow-kv" in sys.argv[0] else "python -m daskflow_kv.bench"
    doc = run(cfg, out_dir, tag, command_line(prog, argv), plots=not args.no_plots, progress=not args.no_progress,
              summary_path=summary, memory_limit=args.memory_limit)
    mismatched = sorted({r["system"] for r in doc.get("runs", []) if r.get("agree") is False})
    if mismatched:
        print(f"outputs differed from text replay for: {', '.join(mismatched)} (speeds not reported)")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
