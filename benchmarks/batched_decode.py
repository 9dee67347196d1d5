"""Decode k forks of one state: sequential resume vs the HF prefix-cache recipe vs batched.

For each model and each k in --ks, the same k ragged suffixes are resumed from one ~512-token
prefix state by
  sequential  Engine.resume per branch (each loads its own copy of the prefix, decodes alone)
  hf-recipe   transformers' prefix caching recipe: prefill the prefix once into a DynamicCache,
              then per branch ``copy.deepcopy(cache)`` + ``model.generate`` (greedy)
  batched     Engine.resume_forks: prefix loaded once, one batched suffix prefill, one forward per
              decode step for all live branches (``--modes``: replay and/or shared attention)
Tokens of every method are checked equal to sequential before any speed is reported.
Prefix materialization is excluded from every timing (it is shared state). Writes a table to
stdout and JSON to benchmarks/results/batched_decode.json.

    python benchmarks/batched_decode.py                      # tiny-llama + smollm2, k = 1 4 16
    python benchmarks/batched_decode.py --models tiny-llama  # seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from daskflow_kv.bench import provenance
from daskflow_kv.engine import Engine

TOPICS = [
    "the scheduler",
    "memory pressure",
    "a lost worker",
    "the cost model",
    "block keys",
    "eviction",
    "the planner",
    "transfer bandwidth",
    "a judge agent",
    "retrieval",
    "tree of thought",
    "debate rounds",
    "prefix reuse",
    "recompute",
    "spilling to disk",
    "the catalog",
]
PARAGRAPH = (
    "Workers hold blocks of tensors in memory and the scheduler moves them when moving is cheaper than "
    "recomputing. The shared context is prefilled once and every agent resumes from the same key value cache. "
    "Agents debate, plan, retrieve and judge; each one reads what the others wrote. "
)


def suffix_text(i: int) -> str:
    # ragged: 1 to 4 clauses
    clauses = [f" Agent {i} asks about {TOPICS[i % len(TOPICS)]}", " and what it costs", " under load", " today"]
    return "".join(clauses[: 1 + i % 4]) + ":"


def hf_recipe(engine: Engine, prefix: list[int], suffixes: list[list[int]], new_tokens: int):
    """The Hugging Face prefix-cache recipe: prefill the prefix once (returned callable not
    timed), then per branch deepcopy the cache and ``generate`` greedily (the callable)."""
    from transformers import DynamicCache

    model, dev = engine.runner.model, engine.runner.device
    eos = sorted(engine.runner.eos_ids)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prefix], device=dev), cache=cache, use_cache=True)

    def generate_all() -> list[list[int]]:
        out = []
        with torch.inference_mode():
            for suf in suffixes:
                ids = torch.tensor([prefix + suf], device=dev)
                seq = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    cache=copy.deepcopy(cache),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=eos[0],
                    temperature=None,
                    top_p=None,
                    top_k=None,
                )
                out.append(seq[0, ids.shape[1] :].tolist())
        return out

    return generate_all


def _mem_start(dev) -> int:
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


def _mem_peak(dev, base: int) -> int | None:
    """Measured peak bytes allocated above ``base`` (CUDA only): KV plus activations and logits."""
    return torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else None


def run_model(
    name: str,
    dtype: str,
    prefix_len: int,
    new_tokens: int,
    ks: list[int],
    modes: list[str],
    repeats: int = 2,
    device: str = "cpu",
) -> dict:
    base = Engine(model=name, dtype=dtype, device=device)
    runner = base.runner
    all_sufs = [base.encode(suffix_text(i)) for i in range(max(ks))]
    # shorten the prefix if prefix + suffix + new tokens would pass the model's positions
    prefix_len = min(prefix_len, runner.max_positions - max(len(s) for s in all_sufs) - new_tokens)
    text = PARAGRAPH * (1 + 4 * prefix_len // max(1, len(base.encode(PARAGRAPH))))
    prefix = base.encode(text)[:prefix_len]
    bpt = runner.bytes_per_token
    rows, agree = [], True

    def fresh():
        eng = Engine(runner=runner)  # own store and index: no method reuses another's blocks
        return eng, eng.materialize(prefix)

    # warm up every path once (twin model creation, first-call allocations)
    eng, st = fresh()
    eng.resume(st, all_sufs[0], max_new_tokens=2)
    for mode in modes:
        eng.resume_forks(st, all_sufs[:2], max_new_tokens=2, attention=mode)
    hf_recipe(eng, prefix, all_sufs[:1], 2)()

    dev = runner.device

    def sequential(sufs):
        eng, st = fresh()
        mem = _mem_start(dev)
        t = time.perf_counter()
        gens = [eng.resume(st, s, max_new_tokens=new_tokens, stream=i) for i, s in enumerate(sufs)]
        wall = time.perf_counter() - t
        decode_s = sum(g.metrics.decode_s for g in gens)
        return (
            [g.tokens for g in gens],
            wall,
            {
                "measured_peak_bytes": _mem_peak(dev, mem),
                "decode_s": decode_s,
                "prefix_bytes_copied": len(sufs) * prefix_len * bpt,
                # one private cache at a time
                "peak_kv_bytes": max(bpt * (prefix_len + len(s) + new_tokens) for s in sufs),
            },
        )

    def hf(sufs):
        eng, _ = fresh()
        go = hf_recipe(eng, prefix, sufs, new_tokens)  # the one prompt prefill is not timed
        mem = _mem_start(dev)
        t = time.perf_counter()
        tokens = go()
        return (
            tokens,
            time.perf_counter() - t,
            {
                "measured_peak_bytes": _mem_peak(dev, mem),
                "decode_s": None,
                "prefix_bytes_copied": len(sufs) * prefix_len * bpt,  # one deepcopy per branch
                # the original prompt cache plus one branch's copy
                "peak_kv_bytes": bpt * (2 * prefix_len + max(len(s) for s in sufs) + new_tokens),
            },
        )

    def batched(mode):
        def go(sufs):
            eng, st = fresh()
            mem = _mem_start(dev)
            t = time.perf_counter()
            gens = eng.resume_forks(st, sufs, max_new_tokens=new_tokens, attention=mode)
            wall = time.perf_counter() - t
            stats = gens.stats
            return (
                [g.tokens for g in gens],
                wall,
                {
                    "measured_peak_bytes": _mem_peak(dev, mem),
                    "decode_s": stats.decode_s,
                    "prefix_bytes_copied": prefix_len * bpt,
                    "peak_kv_bytes": stats.kv_bytes,
                    "kv_ratio": stats.kv_ratio,
                    "ideal_kv_bytes": stats.ideal_kv_bytes,
                    "unshared_kv_bytes": stats.unshared_kv_bytes,
                    "scratch_bytes": stats.scratch_bytes,
                    "forwards": stats.forwards,
                },
            )

        return go

    methods = {"sequential": sequential, "hf-recipe": hf, **{f"batched-{m}": batched(m) for m in modes}}
    for k in ks:
        sufs = all_sufs[:k]
        walls = {m: [] for m in methods}
        extra, ref = {}, None
        for _ in range(repeats):  # interleaved repeats; the best wall time of each method is kept
            for m, fn in methods.items():
                tokens, wall, info = fn(sufs)
                ref = tokens if m == "sequential" and ref is None else ref
                ok = tokens == ref
                agree &= ok
                walls[m].append(wall)
                if wall <= min(walls[m]):
                    extra[m] = info
                extra[m]["agree"] = extra[m].get("agree", True) and ok
        n_tok = sum(len(r) for r in ref)
        n_dec = sum(len(r) - 1 for r in ref)
        best_seq = min(walls["sequential"])
        for m in methods:
            info = dict(extra[m])
            best = min(walls[m])
            dec = info.pop("decode_s")
            rows.append(
                dict(
                    k=k,
                    method=m,
                    wall_s=best,
                    walls_s=walls[m],
                    tokens=n_tok,
                    tok_per_s=n_tok / best,
                    decode_tok_per_s=(n_dec / dec) if dec else None,
                    speedup_vs_sequential=best_seq / best,
                    **info,
                )
            )
    return {
        "model": name,
        "model_id": runner.fingerprint.model_id,
        "dtype": dtype,
        "device": str(dev),
        "prefix_tokens": prefix_len,
        "max_new_tokens": new_tokens,
        "suffix_tokens": [len(s) for s in all_sufs],
        "bytes_per_token": bpt,
        "repeats": repeats,
        "tokens_agree": agree,
        "rows": rows,
    }


def print_table(res: dict) -> None:
    print(
        f"\n{res['model']} {res['dtype']} on {res['device']}  prefix {res['prefix_tokens']} tok, <= {res['max_new_tokens']} new tok/branch,"
        f" tokens agree across methods: {res['tokens_agree']}"
    )
    print(
        f"{'k':>3} {'method':<16} {'wall s':>8} {'tok/s':>8} {'decode tok/s':>12} {'x seq':>6} {'agree':>5} "
        f"{'prefix MiB copied':>17} {'KV MiB':>8} {'KV/(P+tails)':>12}"
        + (f" {'meas. MiB':>9}" if res["device"].startswith("cuda") else "")
    )
    for r in res["rows"]:
        ratio = f"{r['kv_ratio']:.3f}" if "kv_ratio" in r else "-"
        dec = f"{r['decode_tok_per_s']:.1f}" if r["decode_tok_per_s"] else "-"
        print(
            f"{r['k']:>3} {r['method']:<16} {r['wall_s']:>8.3f} {r['tok_per_s']:>8.1f} {dec:>12} "
            f"{r['speedup_vs_sequential']:>6.2f} {r['agree']!s:>5} {r['prefix_bytes_copied'] / 2**20:>17.2f} "
            f"{r['peak_kv_bytes'] / 2**20:>8.2f} {ratio:>12}"
            + (f" {r['measured_peak_bytes'] / 2**20:>9.2f}" if r.get("measured_peak_bytes") is not None else "")
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument(
        "--prefix",
        type=int,
        default=512,
        help="prefix tokens (capped so prefix + suffix + new tokens fit the model's positions)",
    )
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats; the best wall time is reported")
    ap.add_argument("--modes", nargs="+", default=["replay", "shared"], choices=["replay", "shared"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "batched_decode.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    for name in args.models:
        res = run_model(name, args.dtype, args.prefix, args.new_tokens, args.ks, args.modes, args.repeats, args.device)
        print_table(res)
        results.append(res)
    doc = {
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "total_s": time.perf_counter() - t0,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(provenance.stamp(doc), indent=2))
    print(f"\nwrote {out} in {doc['total_s']:.0f} s")
    return 0 if all(r["tokens_agree"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
