"""``daskflow-kv plan``: transfer or recompute a shared context, at cluster scale. MODELED.

For a model (a preset below or any HF ``config.json``) and a hardware profile (prefill
speed from peak FLOP/s x utilization, or a measured tokens/s; link bandwidth and latency),
prints per context length what the cost model (``cost_model.decide``, the same function
the runtime calls) would do with a prefix another worker holds: move its KV bytes, or
prefill it again. Nothing is run or measured here: every number is MODELED.

    daskflow-kv plan --model llama-3-8b --hardware a100-ib200
    daskflow-kv plan --model /path/config.json --hardware ethernet-25g --kv-dtype fp8
    daskflow-kv plan --model mistral-7b --prefill-tps 12000 --bandwidth-gbps 3 --latency-us 300
    daskflow-kv plan --list

Prefill model: t(n) = a + b n + c n^2/2 with b = 2 * (non-embedding params) / (FLOP/s x MFU) and
c = 4 * layers * heads * head_dim / (FLOP/s x MFU) (attention over the causal triangle).
``--prefill-tps`` replaces b by 1/tps (quoted at short contexts) and keeps c.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import validation
from ..errors import InvalidInputError
from ..policy.cost_model import (
    LinkProfile,
    PrefillProfile,
    crossover_bandwidth,
    crossover_tokens,
    decide,
    kv_bytes_per_token,
)

KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
DEFAULT_CONTEXTS = [1024 * 2**i for i in range(8)]  # 1k .. 128k


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    tied_embeddings: bool = False

    @property
    def matmul_params(self) -> int:
        """Parameters every prompt token multiplies through (embedding lookup excluded)."""
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp)

    @property
    def params(self) -> int:
        return self.matmul_params + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype_bytes)


# Public config.json numbers (no hub at run time, so written here).
MODELS = {
    "mistral-7b": ModelConfig("Mistral-7B-v0.1", 32, 4096, 32, 8, 128, 14336, 32000, 32768),
    "llama-3-8b": ModelConfig("Meta-Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
    "llama-3.1-8b": ModelConfig("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
    "llama-3-70b": ModelConfig("Meta-Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, 8192),
    "llama-3.1-70b": ModelConfig("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, 131072),
    "qwen2-7b": ModelConfig("Qwen2-7B", 28, 3584, 28, 4, 128, 18944, 152064, 131072),
    "smollm2-135m": ModelConfig("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, 8192, tied_embeddings=True),
}


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    tflops: float  # dense peak of one device at the compute dtype, TFLOP/s
    mfu: float  # fraction of peak a long prefill reaches
    bandwidth: float  # bytes/s one transfer gets between two devices
    latency: float  # s per transfer: link + transport software (UCX/TCP, Dask dependency fetch)
    overhead: float = 0.005  # s fixed per prefill call (launch, scheduling)


HARDWARE = {
    "h100-nvlink": Hardware("h100-nvlink", "H100 SXM pair over NVLink 4 (~450 GB/s per direction, ~90% usable)",
                            989, 0.5, 400e9, 50e-6),
    "h100-ib400": Hardware("h100-ib400", "H100 nodes over NDR InfiniBand 400 Gb/s (GPUDirect RDMA)",
                           989, 0.5, 45e9, 100e-6),
    "a100-nvlink": Hardware("a100-nvlink", "A100 SXM pair over NVLink 3 (~300 GB/s per direction)",
                            312, 0.5, 270e9, 50e-6),
    "a100-ib200": Hardware("a100-ib200", "A100 nodes over HDR InfiniBand 200 Gb/s (GPUDirect RDMA)",
                           312, 0.5, 22e9, 100e-6),
    "ethernet-100g": Hardware("ethernet-100g", "A100 nodes over 100 GbE, TCP through host memory",
                              312, 0.5, 10e9, 300e-6),
    "ethernet-25g": Hardware("ethernet-25g", "A100 nodes over 25 GbE, TCP through host memory",
                             312, 0.5, 2.8e9, 300e-6),
    "ethernet-10g": Hardware("ethernet-10g", "A100 nodes over 10 GbE, TCP through host memory",
                             312, 0.5, 1.1e9, 300e-6),
    "l4-ethernet-10g": Hardware("l4-ethernet-10g", "L4 nodes over 10 GbE, TCP", 121, 0.45, 1.1e9, 300e-6),
    "cpu-2core-loopback": Hardware("cpu-2core-loopback",
                                   "this project's 2-core CPU box, Dask TCP loopback (measured: ~3 GB/s, 14 ms "
                                   "per dependent fetch; SmolLM2 fp32 prefill ~450 tok/s)", 0.096, 1.0, 3e9, 0.014,
                                   0.0),
}


def load_config(path: str | Path) -> ModelConfig:
    """A ModelConfig from an HF config.json (text config of multimodal ones too)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    return ModelConfig(
        name=cfg.get("_name_or_path") or path.parent.name,
        layers=cfg["num_hidden_layers"], hidden=hidden, heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate=cfg.get("intermediate_size") or 4 * hidden,
        vocab=cfg.get("vocab_size", 32000),
        max_positions=cfg.get("max_position_embeddings", 4096),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def resolve_model(name: str) -> ModelConfig:
    key = name.lower()
    if key in MODELS:
        return MODELS[key]
    if Path(name).exists():
        try:
            return load_config(name)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidInputError(f"--model {name!r} is not a readable HF config.json ({type(e).__name__}: {e})") \
                from None
    raise InvalidInputError(f"unknown model {name!r}: use one of {', '.join(MODELS)} or a config.json path")


def prefill_profile(model: ModelConfig, hw: Hardware, prefill_tps: float | None = None) -> PrefillProfile:
    flops = hw.tflops * 1e12 * hw.mfu
    c = 4 * model.layers * model.heads * model.head_dim / flops
    b = 1.0 / prefill_tps if prefill_tps else 2 * model.matmul_params / flops
    return PrefillProfile(hw.overhead, b, c)


def plan_rows(model: ModelConfig, hw: Hardware, contexts=DEFAULT_CONTEXTS, kv_dtype: str = "bf16",
              prefill_tps: float | None = None) -> list[dict]:
    """One MODELED decision per context length: a prefix held on one device, needed on another."""
    bpt = model.kv_bytes_per_token(KV_DTYPE_BYTES[kv_dtype])
    prof = prefill_profile(model, hw, prefill_tps)
    link = LinkProfile(hw.bandwidth, hw.latency)
    rows = []
    for n in contexts:
        d = decide(n * bpt, n, 0, "holder", "consumer", link, prof)
        best, other = sorted((d.t_transfer, d.t_recompute))
        rows.append({
            "label": "MODELED", "model": model.name, "hardware": hw.name, "context": n, "kv_dtype": kv_dtype,
            "kv_bytes": n * bpt, "t_transfer_s": d.t_transfer, "t_recompute_s": d.t_recompute, "action": d.action,
            "advantage": other / best if best > 0 else math.inf,
            "crossover_bandwidth_gbps": crossover_bandwidth(n * bpt, n, prof, hw.latency) / 1e9,
            "beyond_max_positions": n > model.max_positions,
        })
    return rows


def summary(model: ModelConfig, hw: Hardware, kv_dtype: str = "bf16", prefill_tps: float | None = None) -> dict:
    bpt = model.kv_bytes_per_token(KV_DTYPE_BYTES[kv_dtype])
    prof = prefill_profile(model, hw, prefill_tps)
    link = LinkProfile(hw.bandwidth, hw.latency)
    return {
        "model": asdict(model), "hardware": asdict(hw), "kv_dtype": kv_dtype, "kv_bytes_per_token": bpt,
        "params": model.params, "prefill_tokens_per_s_at_512": prof.tokens_per_second,
        "profile": {"a": prof.a, "b": prof.b, "c": prof.c},
        "transfer_wins_from_tokens": crossover_tokens(bpt, link, prof),
    }


def _fmt_s(t: float) -> str:
    if math.isinf(t):
        return "inf"
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


def render(rows: list[dict], info: dict) -> str:
    m, hw = info["model"], info["hardware"]
    cross = info["transfer_wins_from_tokens"]
    out = [
        (f"MODELED - no measurement. {m['name']}: {m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}, "
        f"{info['params'] / 1e9:.2f} B params, KV {info['kv_dtype']} = {info['kv_bytes_per_token']:,} bytes/token"),
        f"hardware {hw['name']}: {hw['description']}",
        (f"  prefill {hw['tflops']:g} TFLOP/s x MFU {hw['mfu']:g} -> {info['prefill_tokens_per_s_at_512']:,.0f} tok/s at 512 "
        f"tokens; link {hw['bandwidth'] / 1e9:g} GB/s, {hw['latency'] * 1e6:g} us per transfer"),
        "  transfer beats recompute " + ("at every context length" if cross is not None and cross <= 1 else
                                         f"from {cross:,} tokens on" if cross else
                                         "at no context length (recompute always wins)"),
        "",
        (f"{'context':>8} {'KV bytes':>10} {'transfer':>11} {'recompute':>11} {'decision':>9} {'by':>7} "
        f"{'crossover bw':>13}"),
    ]
    for r in rows:
        kv = r["kv_bytes"]
        kvs = f"{kv / 2**30:.2f} GiB" if kv >= 2**30 else f"{kv / 2**20:.1f} MiB"
        note = "  (> model's max positions)" if r["beyond_max_positions"] else ""
        bw = r["crossover_bandwidth_gbps"]
        out.append(f"{r['context']:>8} {kvs:>10} {_fmt_s(r['t_transfer_s']):>11} {_fmt_s(r['t_recompute_s']):>11} "
                   f"{r['action']:>9} {r['advantage']:>6.1f}x {('inf' if math.isinf(bw) else f'{bw:.2f} GB/s'):>13}{note}")
    out.append("")
    out.append("crossover bw: below this link bandwidth recomputing that context is faster (MODELED).")
    return "\n".join(out)


def _check(args) -> tuple[Hardware, ModelConfig]:
    """The hardware (with overrides) and model the flags name, every number checked."""
    v = validation
    hw = HARDWARE[v.choice("--hardware", args.hardware, tuple(HARDWARE))]
    args.contexts = [v.integer("--contexts", n, minimum=1) for n in args.contexts]
    v.optional("--prefill-tps", args.prefill_tps, v.number, above=0)
    over = {k: x for k, x in (("tflops", v.optional("--tflops", args.tflops, v.number, above=0)),
                              ("mfu", v.optional("--mfu", args.mfu, v.number, above=0, maximum=1)),
                              ("bandwidth", v.optional("--bandwidth-gbps", args.bandwidth_gbps, v.number, above=0)),
                              ("latency", v.optional("--latency-us", args.latency_us, v.number, minimum=0)))
            if x is not None}
    over = {k: x * (1e9 if k == "bandwidth" else 1e-6 if k == "latency" else 1) for k, x in over.items()}
    if over:
        hw = Hardware(**{**asdict(hw), **over, "name": hw.name + "*"})
    if args.json:
        v.writable_file("--json", args.json)
    return hw, resolve_model(args.model)


def main(argv=None) -> int:
    ap = validation.ArgumentParser(prog="daskflow-kv plan", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="llama-3-8b", help=f"{' | '.join(MODELS)} | path to config.json")
    ap.add_argument("--hardware", default="a100-ib200", help=" | ".join(HARDWARE))
    ap.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPE_BYTES))
    ap.add_argument("--contexts", type=int, nargs="+", default=DEFAULT_CONTEXTS)
    ap.add_argument("--prefill-tps", type=float, help="measured prefill tokens/s (replaces the FLOP estimate)")
    ap.add_argument("--tflops", type=float, help="override peak TFLOP/s")
    ap.add_argument("--mfu", type=float, help="override utilization")
    ap.add_argument("--bandwidth-gbps", type=float, help="override link bandwidth, GB/s (bytes)")
    ap.add_argument("--latency-us", type=float, help="override per-transfer latency, microseconds")
    ap.add_argument("--json", help="also write the rows and the inputs here")
    ap.add_argument("--list", action="store_true", help="list model and hardware presets")
    args = ap.parse_args(argv)
    if args.list:
        for k, m in MODELS.items():
            print(f"model    {k:<14} {m.name}: {m.layers} layers, {m.kv_heads} KV heads x {m.head_dim}, "
                  f"{m.kv_bytes_per_token(2):,} bytes/token in bf16")
        for k, h in HARDWARE.items():
            print(f"hardware {k:<19} {h.description}")
        return 0
    try:
        hw, model = _check(args)
    except InvalidInputError as e:
        print(f"daskflow-kv plan: error: {e}", file=sys.stderr)
        return 2
    rows = plan_rows(model, hw, args.contexts, args.kv_dtype, args.prefill_tps)
    info = summary(model, hw, args.kv_dtype, args.prefill_tps)
    print(render(rows, info))
    if args.json:
        from .common import write_json

        write_json(Path(args.json), {"label": "MODELED", "inputs": info, "rows": rows,
                                     "command": " ".join(["daskflow-kv plan", *(sys.argv[1:] if argv is None else argv)])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
