"""The GPU check: CUDA KV blocks between two GPU workers over UCX, measured once.

    bash scripts/gpu_check.sh                     # the way to run it (wheels, env, logs)
    python -m daskflow_kv.bench.gpu_check --help  # this driver alone

Phases, each timed, each saved to the result file as soon as it ends (a run cut short keeps
what it measured), each skipped when the time budget would not cover it:

  env        versions, GPU, UCX settings
  build      Llama-3.2-1B shapes with random weights, built offline (``model.zoo.random_llama``)
  cluster    ``cuda_cluster(protocol="ucx")``: two workers on one GPU (CUDA IPC between them)
  exactness  tiny-llama in fp32 and bf16 on CUDA: fork, transfer (blocks move a -> b), resume,
             batched resume, continuation, each against text mode on the same cluster
  transfer   KV bytes a -> b: one KV-shaped bf16 tensor vs one CuPy array of the same bytes,
             and a real 1B state's blocks vs as many CuPy arrays of the same sizes; GB/s from
             the receiver's own transfer log; every CUDA tensor's path counted (frame_counts)
  workflow   RAG on the 1B model, state mode vs text mode: agreement, TTFT, wall time
  tcp        the same KV tensors over a TCP cuda_cluster (host staging: the baseline, and
             the positive control that the counters do see a host path)

Writes ``benchmarks/results/gpu_h200.json`` (``--out``): protocol, agree, transfer_gbps,
cupy_gbps, cupy_ratio, tcp_gbps, host_staging, timings, per-check agreement, every
transfer row, frame counts per phase, UCX protocol tables (``UCX_PROTO_INFO``), errors.
Exit status: 0 every target met, 2 a target missed, 1 a phase failed, 0 (nothing written)
when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from . import gpu_report as gr
from .common import RESULTS_DIR, command_line

PHASES = ("env", "build", "cluster", "exactness", "transfer", "workflow", "tcp")
# Seconds each phase is allowed to start with (else it is skipped and says so).
NEEDS = {"env": 1, "build": 60, "cluster": 45, "exactness": 45, "transfer": 60, "workflow": 90, "tcp": 60}
MODEL_NOTE = "Llama-3.2-1B shapes (published config), random weights drawn offline (seeded); not the trained model"
CONTEXT = (
    "The shared context is prefilled once and every agent resumes from the same key value cache. "
    "Agents debate, plan, retrieve and judge; each one reads what the others wrote. "
)
SUFFIXES = [" Branch one asks: what is shared?", " Branch two: plan the next step of the workers.", " Three.",
            " Branch four wants a much longer suffix so the ragged lengths differ: tree of thought, debate."]
SKIP_MESSAGE = "SKIP gpu_check: no CUDA device visible to torch; nothing measured, no result written"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_h200.json", help="result JSON")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all phases (later ones are skipped)")
    ap.add_argument("--phases", default=",".join(PHASES), help="comma list, subset of " + ",".join(PHASES))
    ap.add_argument("--devices", default=None, help='worker devices, e.g. "0,0" (default: two on a one-GPU machine)')
    ap.add_argument("--sizes-mib", default="64,256,1024", help="single-tensor transfer sizes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--state-tokens", type=int, default=4096, help="tokens of the real 1B state moved as blocks")
    ap.add_argument("--model", default="llama-3.2-1b-random")
    ap.add_argument("--workflow", choices=["rag", "debate"], default="rag")
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every phase on a CPU LocalCluster over TCP (NumPy for CuPy): tests the driver, measures nothing")
    ap.add_argument("--ucx-log-dir", default=os.environ.get("DASKFLOW_KV_UCX_LOG_DIR"),
                    help="directory of UCX_LOG_FILE logs to read protocol tables from")
    args = ap.parse_args(argv)
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in args.phases if p not in PHASES]
    if bad:
        ap.error(f"unknown phase(s) {bad}; choose from {', '.join(PHASES)}")
    args.sizes_mib = [int(s) for s in str(args.sizes_mib).split(",") if s.strip()]
    if not args.sizes_mib or min(args.sizes_mib) < 1 or args.reps < 1:
        ap.error("--sizes-mib needs positive sizes and --reps >= 1")
    return args


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


# -- tasks that run on the workers ------------------------------------------------------------
def make_kv_tensor(shape: tuple[int, ...], seed: int = 0, device: str = "cuda"):
    """A bf16 tensor shaped like a KV block [layers, 2, kv_heads, tokens, head_dim]."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


def make_cupy(nbytes: int, seed: int = 0, device: str = "cuda"):
    """A CuPy float16 array of ``nbytes`` (the same bytes as a bf16 tensor of as many elements);
    NumPy on ``device="cpu"`` (the CPU smoke run)."""
    if device == "cpu":
        import numpy as np

        return np.random.default_rng(seed).standard_normal(nbytes // 2, dtype=np.float32).astype(np.float16)
    import cupy

    return cupy.random.RandomState(seed).standard_normal(nbytes // 2, dtype=cupy.float32).astype(cupy.float16)


def strict_matmul() -> dict:
    """No reduced-precision reductions in cuBLAS bf16/fp16 GEMMs (a worker's rows then round
    the same whatever the batch around them, as exactness between modes needs)."""
    import torch

    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    return {"allow_tf32": torch.backends.cuda.matmul.allow_tf32, "bf16_reduced_precision_reduction": False,
            "fp16_reduced_precision_reduction": False}


def on_device(*objs) -> dict:
    """Depends on its inputs (so Dask moves them here): their bytes and whether all are on the GPU."""
    import torch

    n, device, kinds = 0, True, set()
    for o in objs:
        if isinstance(o, torch.Tensor):
            n += o.numel() * o.element_size()
            device &= o.is_cuda
            kinds.add("torch.cuda" if o.is_cuda else "torch.cpu")
        else:
            n += int(getattr(o, "nbytes", 0))
            device &= hasattr(o, "__cuda_array_interface__")
            kinds.add(type(o).__module__.split(".")[0] + "." + type(o).__name__)
    return {"bytes": n, "all_on_device": device, "kinds": sorted(kinds)}


# -- driver -------------------------------------------------------------------------------------
class _Deadline(Exception):
    pass


def _on_term(signum, frame):
    raise _Deadline(f"signal {signum} (time limit?)")


class Check:
    """One run: the report, the clock, and the cluster of the current phase."""

    def __init__(self, args):
        self.args = args
        self.report = gr.GpuReport(args.out, command_line("gpu_check"))
        self.t0 = time.perf_counter()
        self.cluster = self.client = None
        self.workers: list[str] = []
        self.device = "cpu" if args.cpu_smoke else "cuda"  # where KV blocks live

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.t0)

    def run_phase(self, name: str, fn) -> bool:
        """Run one phase unless deselected or out of time; False if it failed or was skipped."""
        if name not in self.args.phases:
            return True
        if self.left() < NEEDS[name]:
            self.report.error(name, f"skipped: {self.left():.0f} s of the budget left, needs {NEEDS[name]} s")
            return False
        print(f"[gpu_check] {name} ({self.left():.0f} s left)", flush=True)
        t = time.perf_counter()
        try:
            fields = fn() or {}
        except _Deadline:
            raise
        except Exception as e:  # noqa: BLE001 -- record, go on with the next phase
            traceback.print_exc()
            self.report.error(name, "".join(traceback.format_exception_only(type(e), e)).strip())
            self.report.phase(name, time.perf_counter() - t)
            return False
        self.report.phase(name, time.perf_counter() - t, **fields)
        return True

    # -- cluster plumbing
    def ensure(self, protocol: str) -> None:
        """A cluster of ``protocol`` is up (started here if the cluster phase was deselected)."""
        if self.client is None or not (self.args.cpu_smoke or self.workers[0].startswith(protocol)):
            self.start(protocol)

    def start(self, protocol: str) -> float:
        from distributed import Client

        from ..runtime.cuda import cuda_cluster

        self.stop()
        t = time.perf_counter()
        if self.args.cpu_smoke:
            from ..runtime.cluster import local_cluster

            self.cluster = local_cluster(2, 1, dashboard_address=None)
        else:
            self.cluster = cuda_cluster(protocol=protocol, devices=self.args.devices, dashboard_address=None)
        self.client = Client(self.cluster)
        from ..dask_internals import worker_addresses  # dask is installed by now

        self.workers = worker_addresses(self.client)
        if len(self.workers) < 2:
            raise RuntimeError(f"need two workers, got {self.workers}")
        self.report.set(cuda_matmul=next(iter(self.client.run(strict_matmul).values())))
        return time.perf_counter() - t

    def stop(self) -> None:
        for x in (self.client, self.cluster):
            if x is not None:
                try:
                    x.close()
                except Exception:  # noqa: BLE001
                    pass
        self.client = self.cluster = None

    def counts(self) -> dict:
        from ..runtime.cuda import cluster_frame_counts

        return cluster_frame_counts(self.client)

    def move(self, futures, src: str, dst: str, protocol: str, **row) -> dict:
        """A task on ``dst`` reads ``futures`` held on ``src``; GB/s from dst's transfer log."""
        from . import worker_tasks as wt

        keys = {str(f.key) for f in futures}
        self.client.run(wt.clear_transfer_log, workers=[dst])
        t = time.perf_counter()
        got = self.client.submit(on_device, *futures, workers=[dst], allow_other_workers=False, pure=False).result()
        wall = time.perf_counter() - t
        entries = [e for e in self.client.run(wt.transfer_log, workers=[dst])[dst] if keys & set(e["keys"])]
        span = (max(e["stop"] for e in entries) - min(e["start"] for e in entries)) if entries else float("nan")
        return {"protocol": protocol, **row, **got, "transfer_s": span, "wall_s": wall, "messages": len(entries),
                "gbps": got["bytes"] / span / 1e9 if span and span > 0 else float("nan")}


def phase_env(chk: Check) -> dict:
    import torch

    from .common import machine_info

    info = machine_info()
    if chk.args.cpu_smoke:
        return {"machine": info, "smoke": "CPU smoke run: TCP LocalCluster, NumPy for CuPy; not a measurement"}
    versions = {}
    for mod in ("cupy", "dask_cuda", "distributed_ucxx", "ucxx", "rmm"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as e:  # noqa: BLE001
            versions[mod] = f"missing: {type(e).__name__}: {e}"
    p = torch.cuda.get_device_properties(0)
    gpu = {"name": p.name, "memory_bytes": p.total_memory, "count": torch.cuda.device_count(),
           "cuda": torch.version.cuda, "capability": f"{p.major}.{p.minor}"}
    env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "DASK_", "CUDA_VISIBLE", "DASKFLOW_KV"))}
    missing = [m for m, v in versions.items() if str(v).startswith("missing") and m != "rmm"]
    if missing:
        raise RuntimeError(f"GPU packages missing: {missing} (carry the wheels: scripts/gpu_wheels.sh)")
    return {"machine": info, "gpu": gpu, "versions": versions, "env": env}


def phase_build(chk: Check) -> dict:
    """Build the 1B model in a child process (the client process keeps no CUDA context)."""
    import json
    import subprocess

    code = ("import json,sys; from daskflow_kv.model.zoo.random_llama import build_random; "
            "from daskflow_kv.model.zoo.tiny import build_tiny; p = build_random(sys.argv[1]); build_tiny('tiny-llama'); "
            "print(json.dumps({'path': str(p), **json.load(open(p / 'daskflow_kv.json'))}))")
    out = subprocess.run([sys.executable, "-c", code, chk.args.model], capture_output=True, text=True, check=True)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    return {"model": {**info, "note": MODEL_NOTE}}


def phase_cluster(chk: Check) -> dict:
    seconds = chk.start("ucx")
    if not chk.args.cpu_smoke and not all(w.startswith(("ucx://", "ucxx://")) for w in chk.workers):
        raise RuntimeError(f"workers are not on UCX: {chk.workers}")
    return {"protocol": chk.workers[0].split("://")[0], "workers": chk.workers, "timings": {**chk.report.doc["timings"], "cluster_start_s": seconds}}


def _agreement_for(chk: Check, dtype: str) -> dict:
    from ..runtime.kv_runtime import KVRuntime

    rt = KVRuntime(chk.client, "tiny-llama", dtype=dtype, block_size=16, device=chk.device)
    a, b = chk.workers[:2]
    new = 8
    ctx = rt.encode(f"GPU {dtype}: " + CONTEXT * 2)
    sufs = [rt.encode(s) for s in SUFFIXES]
    want = [f.result().generated for f in [rt.generate_text(ctx + s, new, worker=b) for s in sufs]]
    root = rt.materialize(ctx, worker=a)
    rt.wait([root])
    kids = rt.fork(root, len(sufs))
    checks = {"fork_shares_blocks": all(k.state.block_keys == root.state.block_keys for k in kids)}
    runs = {
        "transfer": dict(policy="transfer", workers=[b], batch=False),
        "resume": dict(policy="pin", batch=False),
        "batched_resume": dict(policy="pin", batch=True),
        "batched_transfer": dict(policy="transfer", workers=[b], batch=True),
        "recompute": dict(policy="recompute", workers=[b], batch=False),
    }
    gens = {}
    for name, kw in runs.items():
        gens[name] = rt.resume_many(list(zip(kids, sufs)), max_new_tokens=new, **kw)
        checks[name] = all(g.tokens == w for g, w in zip(gens[name], want))
    checks["transfer_ran_on_b"] = all(g.worker == b and g.placement.action == "transfer" for g in gens["transfer"])
    g0 = gens["transfer"][0]
    more = [g0.tokens[-1]] + rt.encode(" And then?")
    cont = rt.resume(g0.state, more, max_new_tokens=new, policy="transfer", workers=[a])
    checks["continuation"] = cont.tokens == rt.generate_text(list(g0.state.tokens) + more, new, worker=a).result().generated
    return checks


def phase_exactness(chk: Check) -> dict:
    from ..transport import frame_counts as fc

    chk.ensure("ucx")
    before = chk.counts()
    agreement = dict(chk.report.doc["agreement"])
    for dtype in ("float32", "bfloat16"):
        agreement[f"tiny-llama/{dtype}"] = _agreement_for(chk, dtype)
        chk.report.set(agreement=agreement)
    counts = fc.total(fc.delta(chk.counts(), before))
    return {"agreement": agreement, "agree": gr.all_agree(agreement),
            "frame_counts": {**chk.report.doc["frame_counts"], "ucx_exactness": counts}}


def _kv_shape(nbytes: int, layers=16, heads=8, dim=64) -> tuple[int, ...]:
    return (layers, 2, heads, max(1, nbytes // (layers * 2 * heads * dim * 2)), dim)


def _transfer_rows(chk: Check, protocol: str, kinds=("kv-tensor", "cupy")) -> list[dict]:
    from distributed import wait

    a, b = chk.workers[:2]
    rows = []
    dev = chk.device
    warm = [chk.client.submit(make_kv_tensor, _kv_shape(8 << 20), 0, dev, workers=[a], pure=False)]
    if "cupy" in kinds:
        warm.append(chk.client.submit(make_cupy, 8 << 20, 0, dev, workers=[a], pure=False))
    wait(warm)
    for f in warm:  # first connection, IPC handles, allocator warm-up
        chk.move([f], a, b, protocol, kind="warmup")
    del warm
    for rep in range(chk.args.reps):
        for size in chk.args.sizes_mib:
            shape = _kv_shape(size << 20)
            nbytes = 2 * math.prod(shape)
            order = list(kinds) if rep % 2 == 0 else list(kinds)[::-1]
            for kind in order:
                maker = (make_kv_tensor, shape, rep, dev) if kind == "kv-tensor" else (make_cupy, nbytes, rep, dev)
                f = chk.client.submit(*maker, workers=[a], pure=False)
                wait(f)
                rows.append(chk.move([f], a, b, protocol, kind=kind, size_mib=size, rep=rep, keys=1))
                chk.client.cancel([f])
                del f
    return rows


def _block_rows(chk: Check) -> list[dict]:
    """A real 1B state materialized on a, its blocks moved to b, vs CuPy arrays of the same sizes."""
    import random

    from distributed import wait

    from ..runtime.kv_runtime import KVRuntime

    a, b = chk.workers[:2]
    rt = KVRuntime(chk.client, chk.args.model, dtype="bfloat16", block_size=64, device=chk.device)
    rows = []
    for rep in range(chk.args.reps):
        rng = random.Random(rep)
        toks = [rng.randrange(3, 380) for _ in range(min(chk.args.state_tokens, rt.facts.max_positions - 8))]
        st = rt.materialize(toks, worker=a)
        rt.wait([st])
        sizes = chk.client.gather([chk.client.submit(lambda x: x.numel() * x.element_size(), f, workers=[a], pure=False)
                                   for f in st.futures])
        mib = sum(sizes) / 2**20
        rows.append(chk.move(list(st.futures), a, b, "ucx", kind="kv-blocks", size_mib=mib, rep=rep, keys=len(sizes)))
        rt.release(st)
        del st
        arrays = [chk.client.submit(make_cupy, n, i, chk.device, workers=[a], pure=False) for i, n in enumerate(sizes)]
        wait(arrays)
        rows.append(chk.move(arrays, a, b, "ucx", kind="cupy-blocks", size_mib=mib, rep=rep, keys=len(sizes)))
        chk.client.cancel(arrays)
        del arrays
    return rows


def phase_transfer(chk: Check) -> dict:
    from ..transport import frame_counts as fc

    chk.ensure("ucx")
    before = chk.counts()
    rows = _transfer_rows(chk, "ucx")
    chk.report.set(transfer=chk.report.doc["transfer"] + rows)
    try:
        rows += _block_rows(chk)
    except Exception as e:  # noqa: BLE001 -- the single-tensor figures stand on their own
        traceback.print_exc()
        chk.report.error("transfer/blocks", f"{type(e).__name__}: {e}")
    counts = fc.total(fc.delta(chk.counts(), before))
    kv, cp = gr.headline_gbps(rows, "kv-tensor", "ucx"), gr.headline_gbps(rows, "cupy", "ucx")
    blocks = gr.headline_gbps(rows, "kv-blocks", "ucx"), gr.headline_gbps(rows, "cupy-blocks", "ucx")
    all_device = all(r["all_on_device"] for r in rows if r.get("kind") != "warmup")
    return {"transfer": [r for r in chk.report.doc["transfer"] if r.get("protocol") != "ucx"] + rows,
            "transfer_gbps": kv, "cupy_gbps": cp, "cupy_ratio": kv / cp if cp == cp and cp else None,
            "blocks_gbps": blocks[0], "cupy_blocks_gbps": blocks[1],
            "blocks_cupy_ratio": blocks[0] / blocks[1] if blocks[1] == blocks[1] and blocks[1] else None,
            "received_on_device": all_device,
            "frame_counts": {**chk.report.doc["frame_counts"], "ucx_transfer": counts}}


def _mode_timings(res) -> dict:
    ttft = [a.ttft_s for a in res.agents.values()]
    return {"wall_s": res.wall_s, "ttft_mean_s": sum(ttft) / len(ttft), "ttft_max_s": max(ttft),
            "ttft_first_level_mean_s": gr.median([a.ttft_s for a in res.agents.values() if a.level == 0]),
            "agents": {n: {"ttft_s": a.ttft_s, "prefill_s": a.prefill_s, "decode_s": a.decode_s, "worker": a.worker,
                           "tokens_reused": a.tokens_reused, "decision": a.decision} for n, a in res.agents.items()}}


def phase_workflow(chk: Check) -> dict:
    from .. import workflows
    from ..flow.executor import run_workflow
    from ..runtime import tasks
    from ..runtime.kv_runtime import KVRuntime

    chk.ensure("ucx")
    rt = KVRuntime(chk.client, chk.args.model, dtype="bfloat16", block_size=64, device=chk.device)
    for w in chk.workers:  # load the model and warm the kernels everywhere before timing
        chk.client.submit(tasks.text_generate, rt.spec, rt.encode(CONTEXT), 4, None, 0, False, workers=[w],
                          pure=False).result()
    rt.calibrate()
    build = workflows.WORKFLOWS[chk.args.workflow]
    kw = {workflows.AGENT_PARAM[chk.args.workflow]: chk.args.agents}
    wf = build(context_tokens=chk.args.context_tokens, max_new_tokens=chk.args.max_new_tokens, tokenizer=rt.tokenizer,
               **kw)
    cmp = run_workflow(wf, mode="both", runtime=rt)
    agreement = dict(chk.report.doc["agreement"])
    agreement[f"workflow/{chk.args.workflow}/{chk.args.model}/bfloat16"] = cmp.agreement
    timings = {**chk.report.doc["timings"], "workflow": {
        "workflow": chk.args.workflow, "agents": len(cmp.state.agents), "model": chk.args.model,
        "state": _mode_timings(cmp.state), "text": _mode_timings(cmp.text),
        "speedup_wall": cmp.text.wall_s / cmp.state.wall_s if cmp.state.wall_s else None}}
    return {"agreement": agreement, "agree": gr.all_agree(agreement), "timings": timings}


def phase_tcp(chk: Check) -> dict:
    from ..transport import frame_counts as fc

    seconds = chk.start("tcp")
    before = chk.counts()
    rows = _transfer_rows(chk, "tcp", kinds=("kv-tensor",))
    counts = fc.total(fc.delta(chk.counts(), before))
    tcp = gr.headline_gbps(rows, "kv-tensor", "tcp")
    kv = chk.report.doc.get("transfer_gbps")
    return {"transfer": chk.report.doc["transfer"] + rows, "tcp_gbps": tcp,
            "ucx_vs_tcp": kv / tcp if kv and tcp == tcp and tcp else None,
            "tcp_counters_see_host_path": fc.host_path_taken(counts),
            "frame_counts": {**chk.report.doc["frame_counts"], "tcp_transfer": counts},
            "timings": {**chk.report.doc["timings"], "tcp_cluster_start_s": seconds}}


def finish(chk: Check, status: str) -> int:
    from ..transport import frame_counts as fc

    doc = chk.report.doc
    proto = gr.read_ucx_logs(chk.args.ucx_log_dir)
    phases = {k: v for k, v in doc["frame_counts"].items() if k.startswith("ucx_")}
    ucx = fc.total(phases) if phases else None
    staging = gr.host_staging(ucx, proto)
    if doc.get("received_on_device") is False:
        staging = True
    doc.update(ucx_proto=proto, host_staging=staging, status=status)
    doc["timings"]["total_s"] = time.perf_counter() - chk.t0
    doc["verdict"] = gr.verdict(doc)
    chk.report.save()
    print(f"[gpu_check] {status}: agree={doc['agree']} transfer={doc['transfer_gbps']} GB/s "
          f"cupy={doc['cupy_gbps']} GB/s ratio={doc.get('cupy_ratio')} tcp={doc['tcp_gbps']} GB/s "
          f"host_staging={staging} -> {chk.report.path}", flush=True)
    if doc["errors"] or status != "complete":
        return 1
    return 0 if all(v is True for v in doc["verdict"].values()) else 2


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cpu_smoke and not cuda_available():
        print(SKIP_MESSAGE, flush=True)
        return 0
    chk = Check(args)
    signal.signal(signal.SIGTERM, _on_term)
    chk.report.save()
    status = "complete"
    try:
        for name, fn in [("env", phase_env), ("build", phase_build), ("cluster", phase_cluster),
                         ("exactness", phase_exactness), ("transfer", phase_transfer), ("workflow", phase_workflow),
                         ("tcp", phase_tcp)]:
            if not chk.run_phase(name, lambda fn=fn: fn(chk)) and name in ("env", "cluster"):
                status = f"stopped: {name} failed"
                break
    except (_Deadline, KeyboardInterrupt) as e:
        chk.report.error("run", f"stopped: {e}")
        status = "timed out"
    finally:
        chk.stop()
    return finish(chk, status)


if __name__ == "__main__":
    sys.exit(main())
