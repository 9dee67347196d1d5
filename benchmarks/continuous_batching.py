"""Continuous batching on one worker: throughput of a burst, and a newcomer's time to first token.

One Dask worker (one task thread; torch on the host's cores, ``runtime.torch_threads``),
SmolLM2-135M fp32 by default. Eight single-agent requests,
each its own document (different 512-token prompts, no prefix in common), each decoding
``--max-new-tokens`` tokens:

* sequential: one request after another (each submitted when the previous finished) -
  what a worker that runs one KV task at a time gives;
* stream: the same eight arriving as a Poisson process within ``--window`` seconds, each
  submitted at its arrival: they join the worker's running batch (``model.step_engine``).
  Generated tokens/s = all tokens / (last completion - first arrival).

Then the newcomer: seven requests decode, and an eighth arrives. Its TTFT (first token minus
submission) is compared with its own prefill time alone plus two decode steps of the running
batch (the worker's step time while seven decode, from the step loop's own statistics).

Every request's tokens are checked against the same request run alone. Times come from
one clock per host (``time.time()``), ratios within one run, 3 repetitions by default.

    python benchmarks/continuous_batching.py                      # smollm2, 3 reps
    python benchmarks/continuous_batching.py --model tiny-llama --reps 1 --max-new-tokens 16

Writes benchmarks/results/continuous_batching.json (or --out).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json

REQUESTS = 8


def _prompts(rt, n: int, tokens: int) -> list[list[int]]:
    from daskflow_kv.workflows.common import corpus_document

    out = []
    for j in range(n):
        ids = rt.encode(f"Request {j}. Summarize the document.\n" + corpus_document(tokens * 2, rt.tokenizer,
                                                                                    start=7 * j))
        out.append(ids[:tokens])
    return out


def _engine_stats(client) -> dict:
    from daskflow_kv.runtime import step_worker

    [per_model] = client.run(step_worker.engine_stats).values()  # one worker
    [stats] = per_model.values()  # one model
    return stats


def _run(rt, prompt, max_new, stream):
    return rt.generate_text(prompt, max_new, stream=stream)


def sequential(rt, prompts, max_new) -> dict:
    t0 = time.time()
    outs = []
    for i, p in enumerate(prompts):
        outs.append(_run(rt, p, max_new, i).result())
    wall = time.time() - t0
    gen = sum(len(o.generated) for o in outs)
    return {"wall_s": wall, "tokens": gen, "tokens_per_s": gen / wall, "outputs": [o.generated for o in outs],
            "prefill_s": [o.metrics["prefill_s"] for o in outs], "decode_s": [o.metrics["decode_s"] for o in outs]}


def stream(rt, prompts, max_new, window: float, seed: int) -> dict:
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in prompts]
    scale = window / sum(gaps[1:]) if sum(gaps[1:]) > 0 else 0.0
    at = [0.0]
    for g in gaps[1:]:
        at.append(at[-1] + g * scale)
    t0 = time.time()
    futures, submitted = [], []
    for i, (p, t) in enumerate(zip(prompts, at)):
        delay = t0 + t - time.time()
        if delay > 0:
            time.sleep(delay)
        submitted.append(time.time())
        futures.append(_run(rt, p, max_new, i))
    outs = [f.result() for f in futures]
    done = time.time()
    gen = sum(len(o.generated) for o in outs)
    wall = done - t0
    return {"wall_s": wall, "tokens": gen, "tokens_per_s": gen / wall, "arrivals_s": at,
            "ttft_s": [o.metrics["first_token_at"] - s for o, s in zip(outs, submitted)],
            "outputs": [o.generated for o in outs]}


def newcomer(rt, prompts, max_new) -> dict:
    """Seven decode; the eighth arrives once they all do. Its TTFT vs its prefill alone + 2 steps."""
    client = rt.client
    alone = _run(rt, prompts[-1], 1, 99).result()  # its own prefill time, nothing else running
    before = _engine_stats(client)["completed"]
    running = [_run(rt, p, max_new * 4, i) for i, p in enumerate(prompts[:-1])]  # long decodes
    deadline = time.time() + 600
    while time.time() < deadline:  # until all seven have fed their prompts and decode
        st = _engine_stats(client)
        if st["running"] == len(running) and st["rows"] == len(running):
            break
        time.sleep(0.02)
    steps = []
    for _ in range(5):  # the step time while seven decode
        st = _engine_stats(client)
        steps.append(st["step_s"])
        time.sleep(st["step_s"] or 0.05)
    step_s = statistics.median(steps)
    t = time.time()
    late = _run(rt, prompts[-1], max_new, 7).result()
    ttft = late.metrics["first_token_at"] - t
    for f in running:
        f.cancel()
    bound = alone.metrics["prefill_s"] + 2 * step_s
    return {"ttft_s": ttft, "prefill_alone_s": alone.metrics["prefill_s"], "decode_step_s": step_s,
            "bound_s": bound, "within_bound": ttft <= bound, "completed_before": before}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--window", type=float, default=2.0, help="arrivals fall within this many seconds")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "continuous_batching.json")
    args = ap.parse_args(argv)

    from distributed import Client

    from daskflow_kv.runtime import torch_threads
    from daskflow_kv.runtime.cluster import local_cluster
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    t_start = time.time()
    with local_cluster(n_workers=1, threads_per_worker=1) as cluster, Client(cluster) as client:
        rt = KVRuntime(client, args.model)
        prompts = _prompts(rt, REQUESTS, args.prompt_tokens)
        _run(rt, prompts[0][:32], 2, 0).result()  # load the model on the worker
        [worker_threads] = client.run(torch_threads.of_a_new_thread).values()
        reps = []
        for rep in range(args.reps):
            seq = sequential(rt, prompts, args.max_new_tokens)
            st = stream(rt, prompts, args.max_new_tokens, args.window, seed=rep)
            new = newcomer(rt, prompts, args.max_new_tokens)
            agree = st["outputs"] == seq["outputs"]
            row = {"rep": rep, "sequential": {k: v for k, v in seq.items() if k != "outputs"},
                   "stream": {k: v for k, v in st.items() if k != "outputs"}, "newcomer": new, "agree": agree,
                   "speedup": st["tokens_per_s"] / seq["tokens_per_s"]}
            log(f"rep {rep}: sequential {seq['tokens_per_s']:.1f} tok/s, stream {st['tokens_per_s']:.1f} tok/s "
                f"({row['speedup']:.2f}x), agree={agree}; newcomer TTFT {new['ttft_s']:.2f}s vs bound "
                f"{new['bound_s']:.2f}s (prefill {new['prefill_alone_s']:.2f}s + 2 x {new['decode_step_s']:.3f}s)")
            reps.append(row)
    speedups = [r["speedup"] for r in reps]
    ratios = [r["newcomer"]["ttft_s"] / r["newcomer"]["bound_s"] for r in reps]
    summary = {
        "speedup_median": statistics.median(speedups), "speedup_min": min(speedups), "speedup_max": max(speedups),
        "newcomer_ttft_over_bound_median": statistics.median(ratios), "newcomer_ttft_over_bound_max": max(ratios),
        "all_agree": all(r["agree"] for r in reps),
        "targets": {"speedup >= 3x": statistics.median(speedups) >= 3.0,
                    "newcomer TTFT <= prefill + 2 steps": all(r["newcomer"]["within_bound"] for r in reps)},
    }
    doc = {"command": command_line("python benchmarks/continuous_batching.py", argv), "machine": machine_info(),
           "worker_torch_threads": worker_threads, "model": args.model, "requests": REQUESTS,
           "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens, "window_s": args.window,
           "reps": reps, "summary": summary, "minutes": (time.time() - t_start) / 60}
    write_json(args.out, doc)
    log(f"wrote {args.out}: speedup {summary['speedup_median']:.2f}x (min {summary['speedup_min']:.2f}), newcomer "
        f"TTFT/bound {summary['newcomer_ttft_over_bound_median']:.2f}, agree={summary['all_agree']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
