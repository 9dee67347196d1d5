"""``daskflow-kv``: run example workflows in state and text mode and compare them.

    daskflow-kv demo                       # the main job: RAG readers on SmolLM2, both modes
    daskflow-kv run debate --mode both --model tiny-llama --agents 3 --json out.json
    daskflow-kv explain tot --agents 3
    daskflow-kv bench --profile quick          # measured: every system side by side
    daskflow-kv plan --model llama-3-8b --hardware a100-ib200   # modeled, cluster scale
    daskflow-kv catalog --scheduler tcp://host:8786 --out kv.parquet
    daskflow-kv run rag --kv-store /data/kv     # a second run (a new cluster) reads the context from it
    daskflow-kv store ls|du|gc --kv-store /data/kv [--older-than 7d]

The same program is Dask's ``dask kv`` (a ``dask_cli`` entry point, as ``dask cuda worker``):
``dask kv run debate --agents 3`` is ``daskflow-kv run debate --agents 3``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import sys
import time

import click  # distributed's own CLI library: `dask kv` is a click command (dask_cli entry point)


WORKFLOW_NAMES = ("tot", "debate", "rag", "planner")  # == workflows.WORKFLOWS (tests check), no torch import
# The build() defaults of what --agents / --rounds / --depth set, per workflow (tests check
# them against the signatures): enough to count a workflow's agents before building it.
WORKFLOW_SIZES = {"tot": {"agents": 2, "depth": 2}, "debate": {"agents": 2, "rounds": 3}, "rag": {"agents": 3},
                  "planner": {"agents": 3}}


def agent_count(workflow: str, agents=None, rounds=None, depth=None) -> int:
    """How many agents ``_build`` makes for these flags (None: the workflow's default)."""
    d = WORKFLOW_SIZES[workflow]
    a = agents or d["agents"]
    if workflow == "tot":
        return sum(a**level for level in range(1, (depth or d["depth"]) + 1)) + 1  # thoughts + evaluator
    if workflow == "debate":
        return a * (rounds or d["rounds"]) + 1  # debaters per round + moderator
    return a + (1 if workflow == "rag" else 2)  # readers + synthesizer | planner + solvers + judge


def _build(name: str, args, tokenizer):
    from .workflows import AGENT_PARAM, WORKFLOWS

    build = WORKFLOWS[name]
    kwargs = {"tokenizer": tokenizer, "max_new_tokens": args.max_new_tokens, "context_tokens": args.context_tokens}
    if args.agents:
        kwargs[AGENT_PARAM[name]] = args.agents
    params = inspect.signature(build).parameters
    for extra in ("rounds", "depth"):
        if getattr(args, extra, None) and extra in params:
            kwargs[extra] = getattr(args, extra)
    return build(**{k: v for k, v in kwargs.items() if k in params})


class Steps:
    """The CLI's one progress display: a line per long step, its duration added when it ends."""

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self._label: str | None = None
        self._t = 0.0

    def start(self, label: str) -> None:
        self.end()
        self._label, self._t = label, time.perf_counter()
        print(f"{label} ...", end="", file=self.out, flush=True)

    def end(self, note: str = "") -> None:
        if self._label is not None:
            print(f" {time.perf_counter() - self._t:.1f}s{note}", file=self.out, flush=True)
            self._label = None

    def level(self, mode: str, level: int, levels: int, names) -> None:
        """The executor's per-level callback."""
        who = ", ".join(names)
        self.start(f"[{mode}] level {level + 1}/{levels}: {who if len(who) <= 60 else who[:57] + '...'}")


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


def _calibrate(rt, steps: Steps) -> None:
    """Measure links and prefill speed once, before anything is timed (it also loads the
    model on every worker, so neither mode pays that inside its run)."""
    from .policy.cost_model import PrefillProfile

    steps.start("[setup] calibrating worker links and prefill speed")
    cal = rt.calibrate()
    bws = cal["bandwidth"].values()
    rates = [PrefillProfile(p["a"], p["b"], p["c"]).tokens_per_second for p in cal["prefill_profiles"].values()]
    bw = f"{min(bws) / 1e9:.2f}-{max(bws) / 1e9:.2f} GB/s" if bws else "n/a (one worker)"
    tps = f"{min(rates):.0f}-{max(rates):.0f} tok/s" if rates else "n/a"
    steps.end(f" (links {bw}, prefill {tps})")


def _prepare_model(name: str, steps: Steps) -> None:
    """Build or convert the model once, here, before workers ask for it (they would each
    wait for the one that does it, printing nothing)."""
    from .model.zoo.smollm2 import SMOLLM2_ID, smollm2_converted

    if name == SMOLLM2_ID and not smollm2_converted():
        steps.start("[setup] converting SmolLM2 from GGUF to safetensors (once; about a minute)")
    else:
        steps.start(f"[setup] model {name}")
    from .model.zoo.loader import load_tokenizer

    load_tokenizer(name)


def _security(args):
    from .runtime.security import kv_security

    return kv_security(args.tls, args.tls_ca_file, args.tls_cert, args.tls_key)


def _connect(args, steps: Steps):
    """A client on ``--scheduler`` with at least one worker, or a one-line error."""
    from . import config, validation
    from .errors import InvalidInputError
    from .runtime.cluster import connect

    wait = validation.duration("setting daskflow-kv.connect-timeout", config.get("connect-timeout"))
    steps.start(f"[setup] connecting to {args.scheduler}")
    try:
        client = connect(args.scheduler, timeout=max(wait, 5.0), security=_security(args))
    except InvalidInputError:
        raise
    except Exception as e:  # refused mid-handshake, timed out, or not speaking Dask's protocol at all
        raise InvalidInputError(f"--scheduler {args.scheduler}: something answered there, but not as a Dask "
                                f"scheduler ({type(e).__name__}); check the address and port") from None
    try:
        client.wait_for_workers(1, timeout=max(wait, 5.0))
    except (OSError, TimeoutError):
        client.close()
        raise InvalidInputError(f"--scheduler {args.scheduler}: the scheduler has no workers; start some with "
                                f"`dask worker {args.scheduler}`") from None
    return client


def cmd_run(args, workflow: str) -> int:
    from .runtime.cluster import close_runtime, kv_runtime, local_cluster

    steps = Steps()
    print(f"daskflow-kv: {workflow} on {args.model} ({args.dtype}), mode {args.mode}", flush=True)
    from .model.emulated_profile import label_for

    emulated = label_for(args.model)
    if emulated:
        print(f"{emulated}: steps sleep the profile's times; tokens are a hash chain of the prompt", flush=True)
    cluster = client = rt = None
    try:
        if args.scheduler:  # a remote scheduler first: if it is not there, say so before any model work
            client = target = _connect(args, steps)
            _prepare_model(args.model, steps)
        else:
            _prepare_model(args.model, steps)
            security = _security(args)
            steps.start(f"[setup] local cluster: {args.workers} workers x 1 thread" + (", TLS" if security else ""))
            target = cluster = local_cluster(n_workers=args.workers, dashboard_address=":0", kv_budget=args.kv_budget,
                                             silence_logs=logging.WARNING if args.verbose else logging.ERROR,
                                             security=security)
        steps.end()
        link = getattr(cluster or client, "dashboard_link", None)
        if link:
            print(f"Dask dashboard: {link}   KV page: {link.rsplit('/', 1)[0]}/kv", flush=True)
        steps.start(f"[setup] loading {args.model} on the workers")
        budget = {"kv_budget_bytes": args.kv_budget} if args.scheduler and args.kv_budget is not None else {}
        rt = kv_runtime(target, security=getattr(target, "security", None), model=args.model, dtype=args.dtype,
                        block_size=args.block_size, namespace=args.namespace, kv_store=args.kv_store, **budget)
        if args.mode != "text":
            _calibrate(rt, steps)
        steps.end()
        from .flow.executor import Comparison, run_state_mode, run_text_mode

        wf = _build(workflow, args, rt.tokenizer)
        compile_ = lambda: wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size)  # noqa: E731
        result = None
        if args.mode in ("state", "both"):
            result = run_state_mode(compile_(), rt, progress=steps.level, parallel=args.parallel_materialize)
            steps.end()
        if args.mode in ("text", "both"):
            text = run_text_mode(compile_(), rt, progress=steps.level)
            steps.end()
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
        if args.graph:
            (result.state if isinstance(result, Comparison) else result).graph.visualize(args.graph, result=result)
            print(f"\nwrote {args.graph}")
        if args.json:
            with open(args.json, "w") as f:
                payload = result.as_dict()
                payload["command"] = " ".join(["daskflow-kv", *sys.argv[1:]])
                if emulated:
                    payload["emulated"] = emulated
                json.dump(payload, f, indent=2, default=str)
            print(f"\nwrote {args.json}")
        ok = not isinstance(result, Comparison) or result.all_agree
        return 0 if ok else 3
    finally:
        with contextlib.suppress(BrokenPipeError):  # stdout gone (`| head`): still close what we started
            steps.end(" (stopped)")
        if rt is not None:
            close_runtime(rt, cluster)  # drops the KV blocks first, so no worker leaves holding any
        else:
            if client is not None:
                client.close()
            if cluster is not None:
                cluster.close()


def cmd_explain(args) -> int:
    from .flow.workflow import tokenizer_and_limit

    tok, max_pos = tokenizer_and_limit(args.model)
    wf = _build(args.workflow, args, tok)
    cw = wf.compile(tok, max_pos, args.block_size)
    print(cw.explain())
    if args.graph:
        cw.visualize(args.graph)
        print(f"\nwrote {args.graph}")
    return 0


def _graph_file(path) -> str:
    """``--graph``: a writable file whose extension names a format this machine can draw."""
    from . import validation
    from .errors import InvalidInputError
    from .flow.visualize import FORMATS, require_renderer

    fmt = os.path.splitext(str(path))[1].lower().lstrip(".")
    if fmt not in FORMATS:
        raise InvalidInputError(f"--graph {str(path)!r} must end in .{', .'.join(FORMATS)}")
    path = validation.writable_file("--graph", path)
    try:
        require_renderer(fmt)
    except ImportError as e:  # no graphviz package: one line, like every other bad input
        raise InvalidInputError(f"--graph: {e}") from None
    return path


def _common(p: argparse.ArgumentParser, model_key: str) -> None:
    """Options every command shares; defaults come from dask.config["daskflow-kv"]."""
    from . import config

    p.add_argument("--model", default=None,
                   help=f"tiny-llama | tiny-qwen2 | smollm2 | a model directory | emulated:<profile> "
                        f"(default: {config.get(model_key)})")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help=f"(default: {config.get('dtype')})")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per KV block, one Dask key each (default: {config.get('block-size')})")
    p.add_argument("--context-tokens", type=int, default=512, help="approximate size of the shared context")
    p.add_argument("--agents", type=int, default=None, help="agents / branch factor (default: the workflow's)")
    p.add_argument("--rounds", type=int, default=None, help="debate rounds (debate only)")
    p.add_argument("--depth", type=int, default=None, help="tree-of-thought depth (tot only)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--verbose", action="store_true", help="show library logs and progress bars (transformers, Dask)")
    p.add_argument("--graph", default=None, metavar="FILE",
                   help="draw G_s to FILE (.svg/.png/.pdf need Graphviz's dot; .dot does not); after a run it shows "
                        "where each agent ran and what it reused")


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="both", choices=["state", "text", "both"])
    p.add_argument("--scheduler", default=None, help="address of an existing Dask scheduler")
    p.add_argument("--workers", type=int, default=None, help="workers of the embedded local cluster (default: 2)")
    p.add_argument("--kv-budget", default=None, help="per-worker KV byte budget, e.g. 512MiB")
    p.add_argument("--kv-store", default=None,
                   help="persistent KV store: a directory or fsspec URL (default: daskflow-kv.store.url)")
    p.add_argument("--json", default=None, help="write per-agent metrics and agreement here")
    p.add_argument("--explain", action="store_true", help="print G_s and the cost model's decisions")
    p.add_argument("--namespace", default=None,
                   help="tenant to act for (its secret comes from DASK_DASKFLOW_KV__SECRET, never a flag)")
    p.add_argument("--tls", action="store_true", help="the local cluster talks TLS (a temporary self-signed CA)")
    p.add_argument("--tls-ca-file", default=None, help="CA certificate (TLS; with --scheduler tls://...)")
    p.add_argument("--tls-cert", default=None, help="this client's certificate (and the local cluster's)")
    p.add_argument("--tls-key", default=None, help="the private key of --tls-cert")
    p.add_argument("--parallel-materialize", default=None, metavar="auto|W",
                   help="workers a cold shared context is prefilled over: auto (the planner, 1 unless more is "
                        "faster), 1, or W (default: setting daskflow-kv.parallel.materialize)")


def _resolve_config(args) -> None:
    """Flags left unset take their value from dask.config["daskflow-kv"]; every flag and
    every setting it falls back on is checked here, before any cluster or model."""
    from . import config
    from . import validation as v
    from .errors import InvalidInputError
    from .model.zoo.names import check_model, max_positions

    if not hasattr(args, "model"):
        return
    wf = args.workflow
    if wf not in WORKFLOW_NAMES:
        raise InvalidInputError(f"unknown workflow {wf!r}; choose from {', '.join(WORKFLOW_NAMES)}")
    model = args.model if args.model is not None else config.get("demo-model" if args.command == "demo" else "model")
    args.model = check_model(model, "--model" if args.model is not None else "setting daskflow-kv.model")
    args.dtype = v.setting("dtype", args.dtype, "--dtype", v.dtype)
    args.block_size = v.setting("block-size", args.block_size, "--block-size", v.block_size)
    args.max_new_tokens = v.max_new_tokens("--max-new-tokens", args.max_new_tokens)
    args.context_tokens = v.integer("--context-tokens", args.context_tokens, minimum=1)
    limit = max_positions(args.model)
    if limit is not None and args.context_tokens + args.max_new_tokens > limit:
        raise InvalidInputError(f"--context-tokens {args.context_tokens} + --max-new-tokens {args.max_new_tokens} "
                                f"exceed {args.model}'s {limit} positions")
    most = v.integer("setting daskflow-kv.max-fork", config.get("max-fork"), minimum=1)
    for flag, only in (("agents", None), ("rounds", "debate"), ("depth", "tot")):
        value = getattr(args, flag)
        if value is None:
            continue
        if only and wf != only:
            raise InvalidInputError(f"--{flag} applies to the {only} workflow only, not {wf}")
        setattr(args, flag, v.integer(f"--{flag}", value, minimum=1, maximum=most))
    if agent_count(wf, args.agents, args.rounds, args.depth) > most:
        raise InvalidInputError(f"{wf} with these flags has {agent_count(wf, args.agents, args.rounds, args.depth)} "
                                f"agents, more than {most} (setting daskflow-kv.max-fork)")
    if args.graph is not None:
        args.graph = _graph_file(args.graph)
    if not hasattr(args, "workers"):
        return
    for flag in ("tls_ca_file", "tls_cert", "tls_key"):
        if getattr(args, flag) is not None:
            setattr(args, flag, v.readable_file("--" + flag.replace("_", "-"), getattr(args, flag)))
    if bool(args.tls_cert) != bool(args.tls_key):
        raise InvalidInputError("--tls-cert and --tls-key go together")
    if args.tls and (args.tls_ca_file or args.tls_cert):
        raise InvalidInputError("--tls makes a temporary authority; with certificate files leave it out")
    if args.tls and args.scheduler is not None:
        raise InvalidInputError("--tls starts a TLS local cluster; for --scheduler tls://... give --tls-ca-file, "
                                "--tls-cert and --tls-key")
    if args.scheduler is not None and args.scheduler.startswith("tls://") and not args.tls_ca_file:
        import dask  # Dask's own TLS settings may supply the files

        if not dask.config.get("distributed.comm.tls.ca-file", None):
            raise InvalidInputError(f"--scheduler {args.scheduler} is TLS: give --tls-ca-file, --tls-cert and "
                                    "--tls-key (or set distributed.comm.tls.* in Dask's config)")
    if args.scheduler is not None:
        if args.workers is not None:
            raise InvalidInputError("--workers sizes the local cluster; it cannot be combined with --scheduler")
        v.scheduler_reachable("--scheduler", args.scheduler)
    else:
        args.workers = v.setting("cluster.workers", args.workers, "--workers", v.integer, minimum=1)
    args.kv_budget = v.setting("kv-budget", args.kv_budget, "--kv-budget", v.optional, v.byte_size, minimum=0)
    args.kv_store = v.setting("store.url", args.kv_store, "--kv-store", v.optional, v.store_url)
    args.parallel_materialize = v.setting("parallel.materialize", args.parallel_materialize, "--parallel-materialize",
                                          v.parallelism)
    if args.json is not None:
        args.json = v.writable_file("--json", args.json)
    if args.namespace is not None and not isinstance(args.namespace, str):
        raise InvalidInputError("--namespace must be a name")


def _quiet(verbose: bool) -> None:
    """Library logs and bars off unless --verbose, here and in the workers we start.

    Environment variables reach the worker processes a LocalCluster spawns (they read them
    when they import dask); ``daskflow-kv.verbose`` switches the model loaders' bars.
    """
    import logging

    import dask

    os.environ["DASK_DASKFLOW_KV__VERBOSE"] = str(bool(verbose))
    dask.config.set({"daskflow-kv.verbose": bool(verbose)})
    if verbose:
        return
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("distributed", "bokeh", "tornado"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _parser(prog: str = "daskflow-kv"):
    from . import validation

    parser = validation.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", add_help=False, help="benchmark every system and experiment in one run (bench --help)")
    sub.add_parser("plan", add_help=False, help="MODELED transfer vs recompute per context length (plan --help)")
    sub.add_parser("simulate", add_help=False, help="MODELED cluster of N workers, same policies (simulate --help)")
    demo = sub.add_parser("demo", help="the main job: a RAG workflow on SmolLM2, state vs text mode")
    _common(demo, "demo-model")
    _run_options(demo)
    demo.set_defaults(workflow="rag")
    run = sub.add_parser("run", help="run a workflow: tot | debate | rag | planner")
    run.add_argument("workflow", help=" | ".join(WORKFLOW_NAMES))
    _common(run, "model")
    _run_options(run)
    exp = sub.add_parser("explain", help="print a workflow's stateful graph G_s")
    exp.add_argument("workflow", help=" | ".join(WORKFLOW_NAMES))
    _common(exp, "model")
    from .runtime.catalog_export import add_catalog_subcommand

    add_catalog_subcommand(sub)
    from .store.commands import add_store_subcommand

    add_store_subcommand(sub)
    return parser


def _main(argv: list[str], prog: str) -> int:
    if argv[:1] == ["bench"]:  # own argument parsers: hand them the rest untouched
        from .bench.run import main as bench_main
        from .sim.beside import simulate

        return bench_main(argv[1:], simulate_exp7=simulate)
    if argv[:1] == ["plan"]:
        from .bench.plan import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from .sim.cli import main as simulate_main

        return simulate_main(argv[1:])
    args = _parser(prog).parse_args(argv)
    _quiet(getattr(args, "verbose", False))
    _resolve_config(args)
    if args.command == "demo":
        args.explain = True
        return cmd_run(args, "rag")
    if args.command == "run":
        return cmd_run(args, args.workflow)
    if args.command in ("catalog", "store"):
        return args.func(args)
    return cmd_explain(args)


def main(argv=None, prog: str = "daskflow-kv") -> int:
    """Exit status: 0 ok (also when the reader of stdout stopped early, as ``| head`` does),
    2 bad input (one line on stderr), 3 outputs disagreed, 130 interrupted."""
    from .errors import DaskflowKVError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _main(argv, prog)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at interpreter exit
        return code
    except DaskflowKVError as e:  # bad input, a too-long context, a malformed workflow: one line
        if "--verbose" in argv:
            import traceback

            traceback.print_exc()
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return 0


def _drop_stdout() -> None:
    """The reader of stdout went away (``| head``): what it read was all it wanted. Point
    stdout at /dev/null so the interpreter's last flush at exit does not fail as well (the
    recipe of Python's ``signal`` docs; not SIG_DFL for SIGPIPE, which would kill the
    process before a cluster it started is closed)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


@click.command("kv", context_settings={"ignore_unknown_options": True}, add_help_option=False,
               short_help="daskflow-kv: KV-cache workflows on Dask (dask kv --help)")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def dask_kv(ctx, args):
    """``dask kv ...``: the ``daskflow-kv`` command under Dask's CLI (argparse parses ``args``)."""
    ctx.exit(main(list(args), prog="dask kv"))


if __name__ == "__main__":
    sys.exit(main())
