"""What a step of the step loop costs, by what it mixes: measured on one engine, then fitted.

The simulator priced a step as a prefill profile's t(n, p) plus decode rows priced apart, and
ran exp 7 23-31 % faster than measured while each worker's CPU matched its step loop's busy
seconds: the missing time is inside steps that mix things. This benchmark feeds one
``StepEngine`` (SmolLM2 fp32, one torch thread, as a Dask worker runs it) the mixes exp 7's
workers see - requests joining over a cached prefix (their prefix copied in), prompt
chunks next to many decode rows, requests leaving (their blocks cut) - and keeps every
step's shape and wall time (``StepEngine.recent``). ``sim.step_cost.fit_step_cost`` fits
one linear cost per term on them (least squares on relative error, no term tuned by hand).

Run alone, then as two processes at once (``--pair``, the default): the bench's two workers
share one host, so the simulator prices a step with the pair's fit while another worker of
its host is stepping, and with the lone fit otherwise.

    python benchmarks/step_cost.py                   # smollm2, alone then paired (~8 min)
    python benchmarks/step_cost.py --model tiny-llama --quick

Writes benchmarks/results/step_cost.json (or --out): every step's shape, both fits, and
each fit's error on its samples. ``daskflow-kv simulate --step-cost`` reads it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json


def _scenarios(quick: bool) -> list[tuple]:
    """("decode", rows, prefix) and ("mixed", background rows, newcomer prefix, newcomer tokens)."""
    if quick:
        return [("decode", r, 32) for r in (1, 4)] + [("mixed", r, p, 48) for r in (0, 3) for p in (0, 32)]
    out = [("decode", r, p) for p in (512, 1024) for r in (1, 2, 4, 8, 16, 32)]
    out += [("mixed", r, p, n) for r in (0, 2, 8, 16) for p in (0, 512) for n in (64, 256, 1024)]
    return out


def _worker(model: str, quick: bool, out: Path) -> None:
    """One process: an engine, every scenario, the shapes of every step written to ``out``."""
    import torch

    torch.set_num_threads(1)  # as a Dask worker's thread runs it
    from daskflow_kv.engine import Engine
    from daskflow_kv.model.step_engine import StepEngine, StepRequest
    from daskflow_kv.workflows.common import corpus_document

    eng = Engine(model, dtype="float32")
    ids = eng.encode(corpus_document(4000, eng.tokenizer, start=3))
    longest = 64 if quick else 1024
    root = eng.materialize(ids[:longest])
    blocks = [eng.store.get(b.key) for b in root.blocks]
    loop = StepEngine(eng.runner)
    cursor = [longest]

    def fresh(n: int) -> list[int]:  # prompt tokens no request has used: nothing cached by accident
        start = cursor[0] % (len(ids) - n)
        cursor[0] += n
        return ids[start : start + n]

    def req(prefix: int, n: int, max_new: int) -> StepRequest:
        return StepRequest(blocks if prefix else [], prefix, fresh(n), max_new)

    [f.result() for f in loop.submit([req(0, 16, 4)])]  # warm-up, dropped below
    loop.recent.clear()
    # Background decodes outlast the poll below and the newcomer's join: a tiny model's step
    # takes well under a millisecond, and 6 steps ended before the newcomer came on a fast host.
    new_tokens, background_new = (8, 256) if quick else (32, 24)
    for sc in _scenarios(quick):
        if sc[0] == "decode":
            _, rows, prefix = sc
            futs = loop.submit([req(prefix, new_tokens, 16) for _ in range(rows)])
        else:
            _, rows, prefix, n = sc
            futs = loop.submit([req(min(512, longest), new_tokens, background_new) for _ in range(rows)])
            deadline = time.time() + 300
            while rows and time.time() < deadline and loop.stats.rows != rows:  # all of them decoding
                time.sleep(0.005)
            futs += loop.submit([req(prefix, n, 4)])
        [f.result() for f in futs]
    loop.stop()
    out.write_text(json.dumps([s.as_dict() for s in loop.recent]))


def _run(model: str, quick: bool, processes: int, tmp: Path) -> list[list[dict]]:
    paths = [tmp / f"steps_{processes}_{i}.json" for i in range(processes)]
    procs = [subprocess.Popen([sys.executable, __file__, "--model", model, "--worker", str(p)]
                              + (["--quick"] if quick else [])) for p in paths]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a step-cost worker failed (exit {p.returncode})")
    return [json.loads(p.read_text()) for p in paths]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quick", action="store_true", help="a few small scenarios (tests)")
    ap.add_argument("--no-pair", action="store_true", help="alone only")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "step_cost.json")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.model, args.quick, args.worker)
        return 0

    from daskflow_kv.sim.step_cost import fit_step_cost, fit_report

    t0 = time.time()
    tmp = args.out.parent / ".step_cost_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    alone = _run(args.model, args.quick, 1, tmp)[0]
    paired = [] if args.no_pair else [s for steps in _run(args.model, args.quick, 2, tmp) for s in steps]
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    fits = {}
    for name, steps in (("alone", alone), ("paired", paired)):
        if steps:
            cost = fit_step_cost(steps)
            fits[name] = {"cost": cost.as_dict(), **fit_report(cost, steps)}
            log(f"{name}: {len(steps)} steps; {cost.describe()}; RMS {fits[name]['rms_rel_error']:.1%}")
    doc = {"command": command_line("python benchmarks/step_cost.py", argv), "machine": machine_info(),
           "model": args.model, "dtype": "float32", "torch_threads": 1, "scenarios": _scenarios(args.quick),
           "fits": fits, "steps": {"alone": alone, "paired": paired}, "minutes": (time.time() - t0) / 60}
    write_json(args.out, doc)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
