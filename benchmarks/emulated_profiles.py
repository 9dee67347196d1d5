"""Write the emulated engine's profiles (``daskflow_kv/model/profiles/*.json``) from their sources.

    # the CPU profile: fitted on the steps this host's SmolLM2 workers ran in exp 7 runs
    python benchmarks/emulated_profiles.py cpu benchmarks/results/bench_emu_fidelity_real_*.json
    # the H100 profiles: from Vidur's measured H100 operator times (a checkout of microsoft/vidur)
    python benchmarks/emulated_profiles.py h100 /path/to/vidur

**cpu-smollm2** - ``sim.step_cost.fit_in_workers`` on every exp 7 step the bench recorded
inside its Dask workers (``DASKFLOW_KV_BENCH_STEP_SHAPES=1``): the "paired" fit (steps
while the host's other worker was mid-step too, most of a loaded run's), SmolLM2-135M fp32.

**h100-llama3-8b**, **h100-smollm2** - a step's dense work (every layer's projections, MLP,
norms, rope, residual adds, and the embedding) by the tokens it feeds, from Vidur
(Agrawal et al., MLSys 2024; github.com/microsoft/vidur, data/profiling/compute/h100/
meta-llama/Llama-2-7b-hf/mlp.csv: median CUDA time of each operator of one layer, measured
on an H100 at 1-4,096 tokens, tensor parallel 1). Each operator of the emulated model costs
what Vidur measured for the same operator with as many multiply-adds (tokens x its matrix,
relative to Llama-2-7B's), never less than its measured time at one token: the 8B model's
QKV projection is half Llama-2-7B's (8 K/V heads, not 32), its MLP 14,336/11,008 times;
SmolLM2's operators sit at their one-token floors up to ~100 tokens. Vidur's attention
files are not in its repository (stored outside git), so attention is priced from the
H100's datasheet (989 TFLOPS dense BF16, 3.35 TB/s HBM3): prompt attention at 350 TFLOPS
(FlashAttention-2's level on H100: 35 % of peak, Shah et al., FlashAttention-3, 2024),
decode attention reading every cached key's K/V of all layers at 70 % of HBM bandwidth. Each
step adds the LM head over the rows that want logits (its weights read once: datasheet
bandwidth) and an assumed 0.2 ms of scheduling and sampling; prefix loads and block exports
are device-to-device copies (blocks held on the GPU, docs/gpu.md) at half the HBM bandwidth.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

PROFILES = Path(__file__).resolve().parents[1] / "daskflow_kv" / "model" / "profiles"
VIDUR_FILE = "data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv"
VIDUR_URL = "https://github.com/microsoft/vidur/blob/main/" + VIDUR_FILE
H100 = {"bf16_flops": 989e12, "hbm_bytes_s": 3.35e12,
        "url": "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM datasheet: 989 TFLOPS dense BF16, 3.35 TB/s)"}
FA_FLOPS = 350e12  # prompt attention: FlashAttention-2's level on H100 (35 % of peak)
FA_URL = "https://arxiv.org/abs/2407.08608 (FlashAttention-3, Sec. 1: FlashAttention-2 reaches 35 % of H100 peak)"
DECODE_BW = 0.7  # decode attention: share of HBM bandwidth its K/V reads get
COPY_BW = 0.5  # device-to-device copies: read and write
STEP_OVERHEAD_S = 2e-4  # scheduling and sampling per step: an assumption, said in the profile
TOKENS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
# Llama-2-7B (Vidur's measured model): the multiply-adds per token of each operator, and the
# width each elementwise operator runs over.
LLAMA2 = {"hidden": 4096, "inter": 11008, "heads": 32, "kv_heads": 32, "head_dim": 128, "vocab": 32000}
MODELS = {
    "h100-llama3-8b": {"hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128, "layers": 32,
                       "vocab": 128256, "max_positions": 131072, "kv_scale": 32, "tokenizer": "smollm2",
                       "emulates": "Llama-3.1-8B, BF16, on one H100 SXM"},
    "h100-smollm2": {"hidden": 576, "inter": 1536, "heads": 9, "kv_heads": 3, "head_dim": 64, "layers": 30,
                     "vocab": 49152, "max_positions": 8192, "kv_scale": 1, "tokenizer": "smollm2",
                     "emulates": "SmolLM2-135M, BF16, on one H100 SXM"},
}


def _macs(m: dict) -> dict[str, float]:
    """Multiply-adds per token of each projection, and elementwise widths."""
    qkv = m["hidden"] * (m["heads"] + 2 * m["kv_heads"]) * m["head_dim"]
    return {"attn_pre_proj": qkv, "attn_post_proj": m["heads"] * m["head_dim"] * m["hidden"],
            "mlp_up_proj": 2 * m["hidden"] * m["inter"], "mlp_down_proj": m["inter"] * m["hidden"],
            "input_layernorm": m["hidden"], "post_attention_layernorm": m["hidden"], "attn_rope": m["hidden"],
            "add": m["hidden"], "mlp_act": m["inter"], "emb": m["hidden"]}


def _vidur_curves(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Median seconds of each operator by tokens (tensor parallel 1; a token count profiled
    more than once: the mean of its medians)."""
    seen: dict[str, dict[int, list[float]]] = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["num_tensor_parallel_workers"] != "1":
                continue
            for op in _macs(LLAMA2):
                seen.setdefault(op, {}).setdefault(int(r["num_tokens"]), []).append(
                    float(r[f"time_stats.{op}.median"]) / 1e3)
    return {op: _monotone(sorted((n, sum(v) / len(v)) for n, v in by.items())) for op, by in seen.items()}


def _monotone(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Medians are noisy by a few %: never cheaper with more tokens (a running maximum)."""
    out, top = [], 0.0
    for n, y in curve:
        top = max(top, y)
        out.append((n, top))
    return out


def _at(curve: list[tuple[int, float]], tokens: float) -> float:
    """The curve at ``tokens`` (linear between points, its first value below them, past them
    the least-squares slope of its upper half)."""
    if tokens <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if tokens <= x1:
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    upper = [(x, y) for x, y in curve if x >= curve[-1][0] / 2]  # past the last point: the upper half's slope
    mx, my = sum(x for x, _ in upper) / len(upper), sum(y for _, y in upper) / len(upper)
    slope = sum((x - mx) * (y - my) for x, y in upper) / sum((x - mx) ** 2 for x, _ in upper)
    return curve[-1][1] + max(slope, 0.0) * (tokens - curve[-1][0])


def h100_profile(name: str, vidur: Path, commit: str = "") -> dict:
    m = MODELS[name]
    curves = _vidur_curves(vidur / VIDUR_FILE)
    ours, theirs = _macs(m), _macs(LLAMA2)

    def dense(n: int) -> float:
        layer = sum(_at(curves[op], n * ours[op] / theirs[op]) for op in ours if op != "emb")
        return m["layers"] * layer + _at(curves["emb"], n * ours["emb"] / theirs["emb"])

    bytes_per_token = m["layers"] * 2 * m["kv_heads"] * m["head_dim"] * 2  # bf16
    lm_head = m["hidden"] * m["vocab"] * 2 / H100["hbm_bytes_s"]
    pair = 4 * m["heads"] * m["head_dim"] * m["layers"] / FA_FLOPS
    copy = bytes_per_token / (COPY_BW * H100["hbm_bytes_s"])
    return {
        "emulates": m["emulates"],
        "model": {"layers": m["layers"], "kv_heads": m["kv_heads"], "head_dim": m["head_dim"], "dtype": "bfloat16",
                  "max_positions": m["max_positions"]},
        "tokenizer": m["tokenizer"],
        "kv_scale": m["kv_scale"],
        "step_cost": {"fixed": lm_head + STEP_OVERHEAD_S, "per_attn": pair,
                      "per_key": bytes_per_token / (DECODE_BW * H100["hbm_bytes_s"]),
                      "per_join": 2e-5, "per_loaded": copy, "per_exported": copy},
        "token_curve": [[n, round(dense(n), 7)] for n in TOKENS],
        "sources": [
            {"what": "token_curve: dense work of a step by tokens fed", "url": VIDUR_URL, "commit": commit,
             "figure": "median CUDA time of each operator of one Llama-2-7B layer on an H100 (TP 1), scaled "
                       "per operator to this model's multiply-adds; never below its 1-token time"},
            {"what": "per_attn: prompt attention per query-key pair", "url": FA_URL,
             "figure": f"{FA_FLOPS / 1e12:.0f} TFLOPS for 4 x heads x head_dim x layers FLOPs a pair"},
            {"what": "per_key: decode attention per cached token", "url": H100["url"],
             "figure": f"{bytes_per_token} K/V bytes a token read at {DECODE_BW:.0%} of 3.35 TB/s"},
            {"what": "fixed: LM head weights read once a step, plus scheduling and sampling", "url": H100["url"],
             "figure": f"{m['hidden']} x {m['vocab']} BF16 at 3.35 TB/s; + {STEP_OVERHEAD_S * 1e3:.1f} ms assumed"},
            {"what": "per_loaded / per_exported: prefix loads and block cuts as device copies", "url": H100["url"],
             "figure": f"{bytes_per_token} bytes a token at {COPY_BW:.0%} of 3.35 TB/s; per_join 0.02 ms assumed"},
        ],
    }


def cpu_profile(bench_files: list[Path]) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from daskflow_kv.sim.step_cost import fit_in_workers

    runs, commits, hosts = [], set(), set()
    for f in bench_files:
        d = json.loads(f.read_text())
        runs += [r for r in d.get("runs") or () if r.get("system") != "text"]
        prov = d.get("provenance") or {}
        commits.add(prov.get("commit"))
        host = prov.get("host") or {}
        hosts.add(f"{host.get('id')} ({host.get('cpu')}, {host.get('cores')} cores)")
    fit = fit_in_workers({"runs": runs})
    cost = fit["paired"].as_dict()
    cost.pop("samples", None)
    return {
        "emulates": "SmolLM2-135M, float32, on one of this host's 2-core Dask workers beside another",
        "model": {"layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "float32", "max_positions": 8192},
        "tokenizer": "smollm2",
        "kv_scale": 1,
        "step_cost": cost,
        "sources": [{"what": "step_cost: the paired fit of sim.step_cost.fit_in_workers",
                     "files": [str(f) for f in bench_files], "commits": sorted(c or "not recorded" for c in commits),
                     "hosts": sorted(hosts), "fitted_by": "python benchmarks/emulated_profiles.py cpu <files>",
                     "figure": f"{fit['steps']['paired']} steps a peer worker overlapped (of {fit['steps']['every']}; "
                               f"fit of all: RMS relative error {fit['rms_rel_error']:.3f})"}],
    }


def _write(name: str, profile: dict) -> None:
    out = PROFILES / f"{name}.json"
    out.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="kind", required=True)
    c = sub.add_parser("cpu")
    c.add_argument("bench", nargs="+", type=Path, help="bench JSONs whose exp 7 rows carry step shapes")
    h = sub.add_parser("h100")
    h.add_argument("vidur", type=Path, help="a checkout of github.com/microsoft/vidur")
    h.add_argument("--vidur-commit", default="", help="the commit of that checkout (recorded in the profile)")
    args = ap.parse_args(argv)
    if args.kind == "cpu":
        _write("cpu-smollm2", cpu_profile(args.bench))
    else:
        for name in MODELS:
            _write(name, h100_profile(name, args.vidur, args.vidur_commit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
