"""Issue 3: KV transfer throughput between Dask workers, and the cost of fork.

Part 1 - transfer. A 2-process LocalCluster (the project's ``local_cluster``: KV plugin and
torch serializers loaded). For each size, in the same run and interleaved:
  kv-tensor    one block-shaped fp32 torch tensor [layers, 2, kv_heads, T, head_dim]
               (SmolLM2 geometry: 30 x 2 x 3 x T x 64), made on worker A
  numpy        one fp32 NumPy array of exactly the same shape and bytes
  kv-blocks    a real state from ``KVRuntime.materialize`` (one Dask key per 64-token block),
               as many tokens as the size allows within the model's positions
  numpy-blocks the same number of NumPy arrays with the blocks' shapes
A task on worker B depends on the payload; throughput = bytes / (last stop - first start) of
the matching entries of B's ``transfer_incoming_log``; the dependent task's wall time (submit
to result) is reported too. Ratios KV/NumPy are per size and payload layout.

Part 2 - fork. Single-process ``Engine`` per model and context length: materialize cost
(time, bytes written to the block store), fork cost (time per fork of k branches, bytes
copied = 0 expected, from ``store.bytes_copied`` and ``store.nbytes``), the per-branch copy a
resume makes (``RunMetrics.load_s``: prefix blocks into the working cache), and what the HF
recipe does per branch: ``copy.deepcopy`` of a ``DynamicCache`` holding the same K/V.

    python benchmarks/transfer_and_fork.py --quick           # tiny-llama, small sizes (~1 min)
    python benchmarks/transfer_and_fork.py                   # sizes 4..256 MiB, SmolLM2 + tiny-llama

Writes benchmarks/results/transfer_and_fork[_TAG].json and _transfer.csv / _fork.csv.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from daskflow_kv.bench import worker_tasks as wt
from daskflow_kv.bench.common import (
    RESULTS_DIR,
    command_line,
    log,
    machine_info,
    median,
    write_csv,
    write_json,
)

SMOL_GEOMETRY = (30, 3, 64)  # layers, kv heads, head dim: SmolLM2-135M
FP32 = 4


# -- part 1: transfer ---------------------------------------------------------------------------
def _move(client, futures, src: str, dst: str) -> dict:
    """Make a task on dst depend on ``futures`` (held on src); measure from dst's transfer log."""
    keys = {str(f.key) for f in futures}
    client.run(wt.clear_transfer_log, workers=[dst])
    t0 = time.perf_counter()
    got = client.submit(wt.nbytes_of, *futures, workers=[dst], allow_other_workers=False, pure=False).result()
    wall = time.perf_counter() - t0
    entries = [e for e in client.run(wt.transfer_log, workers=[dst])[dst] if keys & set(e["keys"])]
    moved = sum(v for e in entries for k, v in e["keys"].items() if k in keys)
    span = (max(e["stop"] for e in entries) - min(e["start"] for e in entries)) if entries else math.nan
    return {"bytes": got, "bytes_logged": moved, "transfer_s": span, "wall_s": wall, "messages": len(entries),
            "gbps": got / span / 1e9 if span and span > 0 else math.nan}


def _release(client, futures) -> None:
    client.cancel(futures)
    gc.collect()


def transfer_part(model: str, sizes_mib: list[int], reps: int, progress=True) -> tuple[list[dict], dict]:
    from distributed import Client, wait

    from daskflow_kv.bench.systems import drain_kv, shorten_lease, workers_of
    from daskflow_kv.runtime.cluster import local_cluster
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    rows = []
    with local_cluster(2, 1, memory_limit="8GiB", dashboard_address=None) as cluster, Client(cluster) as client:
        rt = KVRuntime(client, model)
        shorten_lease(client)
        a, b = workers_of(client)
        bpt = rt.facts.bytes_per_token
        max_tokens = rt.facts.max_positions - 8
        info = {"model": model, "bytes_per_token": bpt, "block_size": rt.block_size, "src": a, "dst": b}
        # warm the connection both ways (the first connect costs ~35 ms)
        warm = client.submit(wt.make_tensor, (1 << 18,), workers=[a], pure=False)
        _move(client, [warm], a, b)
        _release(client, [warm])
        for rep in range(reps):
            for size in sizes_mib:
                nbytes = size << 20
                layers, heads, dim = SMOL_GEOMETRY
                t = max(1, nbytes // (layers * 2 * heads * dim * FP32))
                shape = (layers, 2, heads, t, dim)
                kinds = ["kv-tensor", "numpy"]
                order = kinds if rep % 2 == 0 else kinds[::-1]
                for kind in order:
                    maker = wt.make_tensor if kind == "kv-tensor" else wt.make_array
                    f = client.submit(maker, shape, rep, workers=[a], pure=False)
                    wait(f)
                    m = _move(client, [f], a, b)
                    _release(client, [f])
                    rows.append({"part": "transfer", "kind": kind, "layout": "one key", "size_mib": size,
                                 "keys": 1, "shape": list(shape), "rep": rep, **m})
                # real blocks from materialize (as many tokens as the model and the size allow)
                n_tok = min(max_tokens, max(1, nbytes // bpt))
                rng = random.Random(7919 * rep + size)
                toks = [rng.randrange(3, rt.facts.vocab_size) for _ in range(n_tok)]
                st = rt.materialize(toks, worker=a)
                rt.wait([st])
                block_shapes = [tuple(s) for s in client.gather(
                    [client.submit(lambda x: tuple(x.shape), f, workers=[a], pure=False) for f in st.futures])]
                mk = _move(client, list(st.futures), a, b)
                rt.release(st)
                del st
                drain_kv(rt, timeout=10)
                arrays = [client.submit(wt.make_array, s, i, workers=[a], pure=False) for i, s in enumerate(block_shapes)]
                wait(arrays)
                mn = _move(client, arrays, a, b)
                _release(client, arrays)
                real = {"size_mib": size, "rep": rep, "tokens": n_tok, "keys": len(block_shapes)}
                rows.append({"part": "transfer", "kind": "kv-blocks", "layout": f"{len(block_shapes)} blocks",
                             "model": model, **real, **mk})
                rows.append({"part": "transfer", "kind": "numpy-blocks", "layout": f"{len(block_shapes)} blocks",
                             **real, **mn})
                if progress:
                    last = rows[-4:]
                    log(f"  rep {rep} {size:>4} MiB: " + ", ".join(
                        f"{r['kind']} {r['bytes'] / 2**20:.1f} MiB {r['gbps']:.2f} GB/s" for r in last))
    return rows, info


def transfer_summary(rows: list[dict]) -> list[dict]:
    out = []
    for size in sorted({r["size_mib"] for r in rows}):
        med = {}
        for kind in ("kv-tensor", "numpy", "kv-blocks", "numpy-blocks"):
            rs = [r for r in rows if r["size_mib"] == size and r["kind"] == kind]
            if rs:
                med[kind] = {"gbps": median([r["gbps"] for r in rs]), "wall_s": median([r["wall_s"] for r in rs]),
                             "transfer_s": median([r["transfer_s"] for r in rs]),
                             "bytes": median([r["bytes"] for r in rs]), "keys": rs[0]["keys"]}
        row = {"size_mib": size}
        for kind, m in med.items():
            for k, v in m.items():
                row[f"{kind}_{k}"] = v
        if "kv-tensor" in med and "numpy" in med:
            row["ratio_gbps_kv_tensor_over_numpy"] = med["kv-tensor"]["gbps"] / med["numpy"]["gbps"]
            row["ratio_wall_kv_tensor_over_numpy"] = med["kv-tensor"]["wall_s"] / med["numpy"]["wall_s"]
        if "kv-blocks" in med and "numpy-blocks" in med:
            row["ratio_gbps_kv_blocks_over_numpy_blocks"] = med["kv-blocks"]["gbps"] / med["numpy-blocks"]["gbps"]
            row["ratio_wall_kv_blocks_over_numpy_blocks"] = med["kv-blocks"]["wall_s"] / med["numpy-blocks"]["wall_s"]
        out.append(row)
    return out


# -- part 2: fork ---------------------------------------------------------------------------------
def _timeit(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts)


def fork_part(model: str, contexts: list[int], k: int, reps: int, progress=True) -> list[dict]:
    from transformers import DynamicCache

    from daskflow_kv.engine import Engine

    base = Engine(model=model)
    runner = base.runner
    rows = []
    limit = runner.max_positions - 4
    # warm up allocations and the first forward
    warm = base.materialize([5] * 64)
    base.resume(warm, [6], max_new_tokens=1)
    for n in contexts:
        n = min(n, limit)
        rng = random.Random(n)
        toks = [rng.randrange(3, runner.vocab_size) for _ in range(n)]
        eng = Engine(runner=runner)  # its own store: no block is reused from another context
        c0 = eng.store.bytes_copied
        t0 = time.perf_counter()
        st = eng.materialize(toks)
        mat_s = time.perf_counter() - t0
        mat_copied = eng.store.bytes_copied - c0
        nbytes = eng.store.nbytes

        c1, b1 = eng.store.bytes_copied, eng.store.nbytes
        forks = []

        def fork_once(eng=eng, st=st, forks=forks):
            forks.append(eng.fork(st, k))

        fork_s = _timeit(fork_once, max(reps, 5))
        fork_copied = eng.store.bytes_copied - c1
        fork_new_bytes = eng.store.nbytes - b1

        # what a branch really copies in daskflow-kv: its prefix into the working cache at resume
        branch = forks[0][0]
        loads = []
        for i in range(reps):
            g = eng.resume(branch, [7 + i], max_new_tokens=1)
            loads.append(g.metrics.load_s)
            eng.release(g.state)

        # the HF recipe: one DynamicCache holding the same K/V, deep-copied per branch
        blocks = [eng.store.get(key) for key in st.block_keys]
        full = torch.cat(blocks, dim=3)  # [layers, 2, kv_heads, n, head_dim]
        cache = DynamicCache(ddp_cache_data=[(full[i, 0].unsqueeze(0).contiguous(), full[i, 1].unsqueeze(0).contiguous())
                                             for i in range(full.shape[0])])
        del full
        cache_bytes = sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
                          for l in cache.layers)
        deep_s = _timeit(lambda cache=cache: copy.deepcopy(cache), reps)
        row = {
            "part": "fork", "model": model, "context": n, "k": k, "state_bytes": st.nbytes, "store_nbytes": nbytes,
            "materialize_s": mat_s, "materialize_bytes_copied": mat_copied,
            "fork_s": fork_s, "fork_s_per_branch": fork_s / k, "fork_bytes_copied": fork_copied,
            "fork_store_bytes_added": fork_new_bytes,
            "resume_load_s": median(loads), "resume_load_bytes": n * runner.bytes_per_token,
            "hf_cache_bytes": cache_bytes, "hf_deepcopy_s": deep_s, "hf_deepcopy_k_s": deep_s * k,
            "hf_deepcopy_k_bytes": cache_bytes * k,
            "deepcopy_over_fork": deep_s / fork_s if fork_s > 0 else math.inf,
        }
        rows.append(row)
        if progress:
            log(f"  {model} {n:>5} tok: materialize {mat_s:.3f}s ({mat_copied / 2**20:.1f} MiB), fork x{k} "
                f"{fork_s * 1e6:.0f} us ({fork_copied} B copied), resume load {row['resume_load_s'] * 1e3:.1f} ms, "
                f"HF deepcopy {deep_s * 1e3:.1f} ms/branch ({cache_bytes / 2**20:.1f} MiB)")
        cache = forks = st = eng = None  # free before the next context
        gc.collect()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny-llama, 4 and 16 MiB, 2 reps, short contexts")
    ap.add_argument("--sizes-mib", type=int, nargs="+")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--transfer-model", help="model whose real blocks are moved (default smollm2, quick tiny-llama)")
    ap.add_argument("--fork-models", nargs="+")
    ap.add_argument("--fork-contexts", type=int, nargs="+")
    ap.add_argument("--k", type=int, default=4, help="branches per fork")
    ap.add_argument("--skip", choices=["transfer", "fork"], action="append", default=[])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the fork part (1, as in a Dask worker; 2 threads on a busy 2-core box add ~40 ms"
                         " thread wake-ups to every copy)")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    sizes = args.sizes_mib or ([4, 16] if args.quick else [4, 16, 64, 256])
    reps = args.reps or (2 if args.quick else 3)
    tmodel = args.transfer_model or ("tiny-llama" if args.quick else "smollm2")
    fmodels = args.fork_models or (["tiny-llama"] if args.quick else ["tiny-llama", "smollm2"])
    fctx = args.fork_contexts or ([128, 512, 1024] if args.quick else [128, 256, 512, 1024, 2048, 4096])
    tag = args.tag or ("quick" if args.quick else "")
    stem = "transfer_and_fork" + (f"_{tag}" if tag else "")
    out = Path(args.out)
    cmd = command_line(f"python {os.path.relpath(__file__)}", argv)
    doc = {"command": cmd, "machine": machine_info(), "config": {
        "sizes_mib": sizes, "reps": reps, "transfer_model": tmodel, "fork_models": fmodels, "fork_contexts": fctx,
        "k": args.k, "threads": args.threads}}
    t0 = time.time()
    if "transfer" not in args.skip:
        log(f"transfer: sizes {sizes} MiB, {reps} reps, real blocks of {tmodel}")
        rows, info = transfer_part(tmodel, sizes, reps)
        doc["transfer"] = {"info": info, "rows": rows, "summary": transfer_summary(rows)}
        write_csv(out / f"{stem}_transfer.csv", rows)
        write_csv(out / f"{stem}_transfer_summary.csv", doc["transfer"]["summary"])
        for r in doc["transfer"]["summary"]:
            log(f"  {r['size_mib']:>4} MiB: kv-tensor {r.get('kv-tensor_gbps', math.nan):.2f} GB/s, numpy "
                f"{r.get('numpy_gbps', math.nan):.2f} GB/s, ratio {r.get('ratio_gbps_kv_tensor_over_numpy', math.nan):.2f}; "
                f"kv-blocks {r.get('kv-blocks_gbps', math.nan):.2f} vs numpy-blocks "
                f"{r.get('numpy-blocks_gbps', math.nan):.2f} GB/s ({r.get('kv-blocks_keys')} keys, "
                f"{r.get('kv-blocks_bytes', 0) / 2**20:.1f} MiB)")
    if "fork" not in args.skip:
        rows = []
        for m in fmodels:
            log(f"fork: {m}, contexts {fctx}, k={args.k}")
            rows += fork_part(m, fctx, args.k, reps)
        doc["fork"] = rows
        write_csv(out / f"{stem}_fork.csv", rows)
    doc["total_s"] = time.time() - t0
    path = write_json(out / f"{stem}.json", doc)
    log(f"wrote {path} (+ CSVs) in {doc['total_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
