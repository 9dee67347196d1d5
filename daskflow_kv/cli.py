"""``daskflow-kv``: run example workflows in state and text mode and compare them.

    daskflow-kv demo                       # the main job: RAG readers on SmolLM2, both modes
    daskflow-kv run debate --mode both --model tiny-llama --agents 3 --json out.json
    daskflow-kv explain tot --agents 3
    daskflow-kv bench --profile quick          # measured: every system side by side
    daskflow-kv plan --model llama-3-8b --hardware a100-ib200   # modeled, cluster scale
    daskflow-kv catalog --scheduler tcp://host:8786 --out kv.parquet
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time


def _build(name: str, args, tokenizer):
    from .workflows import AGENT_PARAM, WORKFLOWS

    if name not in WORKFLOWS:
        raise SystemExit(f"unknown workflow {name!r}; choose from {', '.join(WORKFLOWS)}")
    build = WORKFLOWS[name]
    kwargs = {"tokenizer": tokenizer, "max_new_tokens": args.max_new_tokens, "context_tokens": args.context_tokens}
    if args.agents:
        kwargs[AGENT_PARAM[name]] = args.agents
    params = inspect.signature(build).parameters
    for extra in ("rounds", "depth"):
        if getattr(args, extra, None) and extra in params:
            kwargs[extra] = getattr(args, extra)
    return build(**{k: v for k, v in kwargs.items() if k in params})


def _progress(mode: str, level: int, levels: int, names) -> None:
    print(f"  [{mode}] level {level + 1}/{levels}: {', '.join(names)}", flush=True)


def _table(cmp_or_result) -> str:
    from .flow.executor import Comparison

    state = cmp_or_result.state if isinstance(cmp_or_result, Comparison) else cmp_or_result
    text = cmp_or_result.text if isinstance(cmp_or_result, Comparison) else None
    head = f"{'agent':<14}{'lvl':>4} {'plan':<10}{'reused':>7}{'computed':>9}{'TTFT state':>11}"
    head += f"{'TTFT text':>10}{'agree':>7}" if text else ""
    rows = [head, "-" * len(head)]
    for name, a in state.agents.items():
        row = f"{name:<14}{a.level:>4} {a.decision:<10}{a.tokens_reused:>7}{a.tokens_computed:>9}{a.ttft_s:>10.3f}s"
        if text:
            t = text.agents[name]
            row += f"{t.ttft_s:>9.3f}s{('yes' if t.tokens == a.tokens else 'NO'):>7}"
        rows.append(row)
    return "\n".join(rows)


def _summary(cmp) -> str:
    s, t = cmp.state, cmp.text
    sp = sum(a.tokens_computed for a in s.agents.values())
    lines = [
        f"wall time      state {s.wall_s:7.2f}s   text {t.wall_s:7.2f}s   ({t.wall_s / max(s.wall_s, 1e-9):.2f}x)",
        f"tokens prefilled  state {sum(s.level_tokens_computed):6d}    text {sum(t.level_tokens_computed):6d}"
        f"   ({sum(t.level_tokens_computed) / max(1, sum(s.level_tokens_computed)):.2f}x fewer in state mode)",
        f"agent suffixes prefilled in state mode: {sp} tokens",
        f"token agreement: {sum(cmp.agreement.values())}/{len(cmp.agreement)} agents identical",
    ]
    return "\n".join(lines)


def _outputs(cmp) -> str:
    from .flow.executor import Comparison

    state = cmp.state if isinstance(cmp, Comparison) else cmp
    out = []
    for name, a in state.agents.items():
        text = " ".join(a.text.split())
        out.append(f"- {name}: {text[:160]}{'...' if len(text) > 160 else ''}")
    return "\n".join(out)


def _calibrate(rt) -> None:
    """Measure links and prefill speed once, before anything is timed (it also loads the
    model on every worker, so neither mode pays that inside its run)."""
    from .policy.cost_model import PrefillProfile

    t = time.perf_counter()
    cal = rt.calibrate()
    bws = cal["bandwidth"].values()
    rates = [PrefillProfile(p["a"], p["b"], p["c"]).tokens_per_second for p in cal["prefill_profiles"].values()]
    bw = f"{min(bws) / 1e9:.2f}-{max(bws) / 1e9:.2f} GB/s" if bws else "n/a (one worker)"
    tps = f"{min(rates):.0f}-{max(rates):.0f} tok/s" if rates else "n/a"
    print(f"calibrated in {time.perf_counter() - t:.1f}s: worker links {bw}, prefill {tps}", flush=True)


def cmd_run(args, workflow: str) -> int:
    from .flow.executor import Comparison, run_state_mode, run_text_mode
    from .runtime.cluster import close_runtime, kv_runtime, local_cluster

    t0 = time.perf_counter()
    if args.scheduler:
        target = args.scheduler
    else:
        print(f"starting a local cluster: {args.workers} workers x 1 thread", flush=True)
        target = local_cluster(n_workers=args.workers, dashboard_address=":0", kv_budget=args.kv_budget)
    rt = kv_runtime(target, model=args.model, dtype=args.dtype, block_size=args.block_size)
    try:
        if getattr(rt.client, "dashboard_link", None):
            print(f"Dask dashboard: {rt.client.dashboard_link}", flush=True)
            print(f"KV page:        {rt.client.dashboard_link.rsplit('/', 1)[0]}/kv", flush=True)
        print(f"model {args.model} ({args.dtype}) ready in {time.perf_counter() - t0:.1f}s", flush=True)
        if args.mode != "text":
            _calibrate(rt)
        wf = _build(workflow, args, rt.tokenizer)
        compile_ = lambda: wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size)  # noqa: E731
        result = None
        if args.mode in ("state", "both"):
            print(f"running {wf.name} in state mode", flush=True)
            result = run_state_mode(compile_(), rt, progress=_progress)
        if args.mode in ("text", "both"):
            print(f"running {wf.name} in text mode", flush=True)
            text = run_text_mode(compile_(), rt, progress=_progress)
            result = Comparison(result, text) if result is not None else text
        print()
        print(_outputs(result))
        print()
        print(_table(result))
        if isinstance(result, Comparison):
            print()
            print(_summary(result))
        if args.explain and args.mode != "text":
            print()
            print((result.state if isinstance(result, Comparison) else result).explain)
        if args.json:
            with open(args.json, "w") as f:
                payload = result.as_dict()
                payload["command"] = " ".join(["daskflow-kv", *sys.argv[1:]])
                json.dump(payload, f, indent=2, default=str)
            print(f"\nwrote {args.json}")
        ok = not isinstance(result, Comparison) or result.all_agree
        return 0 if ok else 3
    finally:
        close_runtime(rt)
        if not args.scheduler:
            target.close()


def cmd_explain(args) -> int:
    from transformers import AutoConfig

    from .model.zoo.loader import load_tokenizer, resolve_model_path

    tok = load_tokenizer(args.model)
    max_pos = AutoConfig.from_pretrained(resolve_model_path(args.model)).max_position_embeddings
    wf = _build(args.workflow, args, tok)
    print(wf.compile(tok, max_pos, args.block_size).explain())
    return 0


def _common(p: argparse.ArgumentParser, model_key: str) -> None:
    """Options every command shares; defaults come from dask.config["daskflow-kv"]."""
    from . import config

    p.add_argument("--model", default=None,
                   help=f"tiny-llama | tiny-qwen2 | smollm2 | a path or hub id (default: {config.get(model_key)})")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help=f"(default: {config.get('dtype')})")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per KV block, one Dask key each (default: {config.get('block-size')})")
    p.add_argument("--context-tokens", type=int, default=512, help="approximate size of the shared context")
    p.add_argument("--agents", type=int, default=0, help="agents / branch factor (workflow default if 0)")
    p.add_argument("--rounds", type=int, default=0, help="debate rounds")
    p.add_argument("--depth", type=int, default=0, help="tree-of-thought depth")
    p.add_argument("--max-new-tokens", type=int, default=32)


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="both", choices=["state", "text", "both"])
    p.add_argument("--scheduler", default=None, help="address of an existing Dask scheduler")
    p.add_argument("--workers", type=int, default=None, help="workers of the embedded local cluster (default: 2)")
    p.add_argument("--kv-budget", default=None, help="per-worker KV byte budget, e.g. 512MiB")
    p.add_argument("--json", default=None, help="write per-agent metrics and agreement here")
    p.add_argument("--explain", action="store_true", help="print G_s and the cost model's decisions")


def _resolve_config(args) -> None:
    """Flags left unset take their value from dask.config["daskflow-kv"]."""
    from . import config

    if hasattr(args, "model"):
        args.model = config.get("demo-model" if args.command == "demo" else "model", args.model)
        args.dtype = config.get("dtype", args.dtype)
        args.block_size = config.get("block-size", args.block_size)
    if hasattr(args, "workers"):
        args.workers = config.get("cluster.workers", args.workers)


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # own argument parsers: hand them the rest untouched
        from .bench.run import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["plan"]:
        from .bench.plan import main as plan_main

        return plan_main(argv[1:])
    parser = argparse.ArgumentParser(prog="daskflow-kv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", add_help=False, help="benchmark every system and experiment in one run (bench --help)")
    sub.add_parser("plan", add_help=False, help="MODELED transfer vs recompute per context length (plan --help)")
    demo = sub.add_parser("demo", help="the main job: a RAG workflow on SmolLM2, state vs text mode")
    _common(demo, "demo-model")
    _run_options(demo)
    run = sub.add_parser("run", help="run a workflow: tot | debate | rag | planner")
    run.add_argument("workflow")
    _common(run, "model")
    _run_options(run)
    exp = sub.add_parser("explain", help="print a workflow's stateful graph G_s")
    exp.add_argument("workflow")
    _common(exp, "model")
    from .runtime.catalog_export import add_catalog_subcommand

    add_catalog_subcommand(sub)
    args = parser.parse_args(argv)
    _resolve_config(args)
    if args.command == "demo":
        args.explain = True
        return cmd_run(args, "rag")
    if args.command == "run":
        return cmd_run(args, args.workflow)
    if args.command == "catalog":
        return args.func(args)
    return cmd_explain(args)


if __name__ == "__main__":
    sys.exit(main())
