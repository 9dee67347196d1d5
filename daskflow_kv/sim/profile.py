"""What a modeled worker and link cost: a ``SimProfile``, fitted on this machine or a preset.

Fitted: the ``calibration`` section of a bench results JSON (``benchmarks/results/
bench_full.json``): one fitted ``PrefillProfile`` per worker (t(n, p) = a + b n + c n (p + n/2))
and the measured bandwidth and latency of every worker pair, plus the model's KV bytes per
token. A forward step of the step loop costs what the profile says for the tokens it feeds
(``step_seconds``). Decode rows are priced by a ``decode.DecodeProfile`` fitted on the same
JSON's measured decode timings when it has them (``fixed`` instead of ``a`` for a decode-only
step, ``per_row + per_key p`` a row instead of ``b + c p``), and a decode-only step pays
``shared`` more while another worker of its host steps: the bench's workers all ran on the
one machine its ``machine`` records. Without decode timings a decode row is a one-token
prefill - the convention ``policy.placement.batch_seconds`` (the planner's) uses.

Presets: a GPU and interconnect from public figures (peak bf16 FLOP/s at an assumed 50 %
model FLOP utilisation for prefill, HBM bandwidth for a step's weight read, link line rate
at ~85 %), for Llama-3.1-8B in bf16 (32 layers, 8 KV heads x 128: 131,072 KV bytes per
token). Every figure they give is MODELED, never measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..policy.cost_model import DEFAULT_LATENCY, LinkProfile, PrefillProfile, kv_bytes_per_token
from ..policy.store_read import StoreProfile
from .decode import DecodeProfile, decode_samples, fit_decode
from .step_cost import StepCost, bench_step_rows, fit_in_workers


@dataclass(frozen=True, slots=True)
class SimProfile:
    """Costs of modeled workers: worker i gets ``prefill[i % len(prefill)]``."""

    name: str  # "fitted:<file>" or a preset's name
    prefill: tuple[PrefillProfile, ...]  # per modeled worker, cycled
    link: LinkProfile  # every pair of workers (the mean of the measured pairs when fitted)
    bytes_per_token: int  # K and V of one token, all layers
    store: StoreProfile | None = None  # the persistent tier, when modeled
    task_overhead_s: float = DEFAULT_LATENCY  # s a task waits to reach its worker (scheduler hop)
    links: dict = field(default_factory=dict)  # (i, j) -> LinkProfile for measured pairs (fitted, 2 workers)
    source: str = ""  # one line: where the numbers come from
    decode: DecodeProfile | None = None  # decode rows' measured costs (None: one-token prefills)
    workers_per_host: int = 1  # consecutive workers sharing one host's cores and memory
    # (alone, while another worker of the host steps): whole steps priced by what they mix,
    # fitted on measured steps (``with_step_costs``); None: ``step_seconds`` adds prefill and decode
    step_costs: tuple[StepCost, StepCost] | None = None
    # the bench JSON whose Dask workers' steps the step costs were fitted on: they already carry
    # what the host's clients and scheduler took, so ``slowed`` leaves them (None: a lone engine's)
    step_costs_from: str | None = None
    # how far measured steps scatter around the step costs' price (the fit's RMS relative
    # residual; 0: not measured), and the scatter each modeled step draws from (0: none, the
    # default: every step costs its price) with the seed of its draws (``noisy``, ``sim.ensemble``)
    step_scatter: float = 0.0
    step_noise: float = 0.0
    noise_seed: int = 0
    # what the ``local`` baseline's router prices with, per worker, cycled (None: ``prefill``):
    # in a bench run, the runtime's profiles when exp 7 began, not the ones it ended on
    router: tuple[PrefillProfile, ...] | None = None

    def worker_prefill(self, i: int) -> PrefillProfile:
        return self.prefill[i % len(self.prefill)]

    def worker_router(self, i: int) -> PrefillProfile:
        return self.worker_prefill(i) if self.router is None else self.router[i % len(self.router)]

    def pair(self, i: int, j: int) -> LinkProfile:
        return self.links.get((i, j)) or self.link

    def slowed(self, factor: float) -> "SimProfile":
        """Every forward ``factor`` times slower (links unchanged): workers that get only part of
        their cores because other processes of the host (the clients, the scheduler) take the
        rest. ``router`` stays: the bench's router priced with its profiles, not the host's load."""
        if factor == 1.0:
            return self
        f = float(factor)
        prefill = tuple(replace(p, a=p.a * f, b=p.b * f, c=p.c * f) for p in self.prefill)
        decode = None if self.decode is None else replace(
            self.decode, fixed=self.decode.fixed * f, per_row=self.decode.per_row * f,
            per_key=self.decode.per_key * f, shared=self.decode.shared * f)
        costs = self.step_costs
        if costs is not None and not self.step_costs_from:
            costs = tuple(c.scaled(f) for c in costs)
        return replace(self, prefill=prefill, decode=decode, step_costs=costs,
                       source=f"{self.source}; forwards x{f:.3f}")

    def noisy(self, seed: int) -> "SimProfile":
        """Every modeled step's time drawn around its price, as scattered as the measured steps
        (``step_scatter``), from draws seeded by ``seed``: one of many replays of a row."""
        return replace(self, step_noise=self.step_scatter, noise_seed=int(seed))

    def with_step_costs(self, path: str | Path, skip: int | None = None) -> "SimProfile":
        """Steps priced by measured whole steps: the fits of a ``benchmarks/step_cost.py``
        results JSON (a lone engine; ``paired`` while another worker of the host steps), or
        fitted on the steps a bench JSON's exp 7 rows recorded in their Dask workers
        (``step_cost.fit_in_workers``; ``skip``: but the row ``runs[skip]``). The policies keep
        the profile's prefill profiles: they are what the runtime planned with."""
        data = json.loads(Path(path).read_text())
        fits = data.get("fits") or {}
        if "alone" in fits:
            alone = StepCost.from_dict(fits["alone"]["cost"])
            shared = StepCost.from_dict(fits["paired"]["cost"]) if "paired" in fits else alone
            return replace(self, step_costs=(alone, shared), step_costs_from=None,
                           source=f"{self.source}; steps priced by {Path(path).name} (a lone engine: "
                                  f"{alone.samples} steps alone, {shared.samples} paired)")
        if not bench_step_rows(data):
            raise ValueError(f"{path}: neither a step-cost fit (benchmarks/step_cost.py) nor exp 7 rows with "
                             f"step shapes (bench with DASKFLOW_KV_BENCH_STEP_SHAPES=1)")
        fit = fit_in_workers(data, skip=skip)
        n = fit["steps"]
        return replace(self, step_costs=(fit["alone"], fit["paired"]), step_costs_from=str(path),
                       step_scatter=fit["rms_rel_error"],
                       source=f"{self.source}; steps priced by the {n['every']} steps exp 7's Dask workers ran in "
                              f"{Path(path).name} ({n['alone']} alone, {n['paired']} beside a peer's)")


ROUTER_PRICES = ("as-run", "fitted", "calibration")  # what a replayed ``local`` router prices with


def router_profiles(data: dict, row: dict, prices: str = "as-run") -> tuple[PrefillProfile, ...] | None:
    """The prefill profiles a replay of a measured ``local`` row prices its router with, in
    ``fitted_profile``'s worker order (None: the modeled workers' own, ``fitted``).

    ``as-run``: what the bench's router priced with, where known - the row's record
    (``router_profiles``), else the run's calibration if nothing refitted the runtime's
    profiles before exp 7 began (no daskflow-kv and no exp 3 prefills: the router took the
    calibration then); otherwise unknown, and None. ``calibration``: the run's calibration
    for every row, known or not (a stand-in, for comparison)."""
    cal = (data.get("calibration") or {}).get("prefill_profiles")
    cfg = data.get("config") or {}
    if prices == "fitted":
        return None
    if prices == "calibration":
        profs = cal
    elif prices == "as-run":
        refitted = "dkv" in (cfg.get("systems") or ("dkv",)) or 3 in (cfg.get("experiments") or (3,))
        profs = row.get("router_profiles") or (None if refitted else cal)
    else:
        raise ValueError(f"router prices {prices!r}: expected one of {', '.join(ROUTER_PRICES)}")
    if not profs:
        return None
    order = sorted(data.get("prefill_profiles_end") or cal or profs)  # fitted_profile's modeled workers
    if not set(profs) <= set(order):  # a worker the fit does not know (replaced mid-run): the router's own order
        order = sorted(profs)
    zero = {"a": 0.0, "b": 0.0, "c": 0.0}  # the router prices a worker it has no profile for at nothing
    return tuple(PrefillProfile(float(p["a"]), float(p["b"]), float(p["c"]))
                 for p in ((profs.get(w) or zero) for w in order))


def host_slowdown(cores: int, workers: int, other_cores: float) -> float:
    """How much slower each of ``workers`` single-threaded workers steps on a host of ``cores``
    when other processes keep ``other_cores`` cores busy on average: 1 while the rest still
    leaves a core per worker, else workers / cores left (the cores left shared evenly)."""
    left = max(cores - max(other_cores, 0.0), 1e-3)
    return max(1.0, workers / left)


def step_seconds(p: PrefillProfile, feeds, decode: DecodeProfile | None = None, shared: bool = False) -> float:
    """One forward step over ``feeds`` = [(tokens fed, tokens already in that request's cache)].

    Without ``decode``: one fixed cost, per-token work and each row's attention (the prefill
    profile's terms), a decode row being a one-token prefill. With it: prompt rows as the
    profile says (its ``a`` the step's fixed cost), decode rows (one token) as ``decode``
    says, ``decode.fixed`` the fixed cost of a step with no prompt rows, plus ``shared``
    when ``shared`` (another worker of the host is stepping; measured on decode steps, a
    prompt step's figure already holds it: ``parallel`` rows, two workers at 0.93-1.19x one)."""
    tokens = attn = rows = 0.0
    for n, pos in feeds:
        if decode is not None and n == 1:
            rows += decode.row_seconds(pos)
            continue
        tokens += n
        attn += n * (pos + n / 2)
    if decode is None:
        return p.a + p.b * tokens + p.c * attn
    if tokens:
        return p.a + p.b * tokens + p.c * attn + rows
    return decode.fixed + rows + (decode.shared if shared else 0.0)


def fitted_profile(path: str | Path) -> SimProfile:
    """This machine's profile from a bench results JSON's ``prefill_profiles_end`` (else its
    ``calibration``), links and ``model``."""
    data = json.loads(Path(path).read_text())
    cal = data.get("calibration") or {}
    # The profiles the run ended on (refitted from its own prefills) when the JSON has them:
    # a calibration taken before them may hold a single probe's rate.
    profs = data.get("prefill_profiles_end") or cal.get("prefill_profiles") or {}
    if not profs:
        raise ValueError(f"{path}: no calibration.prefill_profiles to fit a profile from")
    workers = sorted(profs)
    prefill = tuple(PrefillProfile(float(profs[w]["a"]), float(profs[w]["b"]), float(profs[w]["c"])) for w in workers)
    links, bws, lats = {}, [], []
    for pair, bw in (cal.get("bandwidth") or {}).items():
        src, dst = pair.split("->")
        lat = (cal.get("latency") or {}).get(pair) or DEFAULT_LATENCY
        if src in workers and dst in workers:
            links[(workers.index(src), workers.index(dst))] = LinkProfile(float(bw), float(lat))
        bws.append(float(bw))
        lats.append(float(lat))
    link = LinkProfile(sum(bws) / len(bws), sum(lats) / len(lats)) if bws else LinkProfile(1e9)
    bpt = int((data.get("model") or {}).get("bytes_per_token") or 46080)
    decode = fit_decode(decode_samples(data.get("runs") or ()))
    machine = data.get("machine") or {}
    # every worker of a bench run shares the one machine it records (a LocalCluster)
    per_host = len(prefill) if machine else 1
    dec = (f"; decode {decode.fixed * 1e3:.0f} ms + {decode.per_row * 1e3:.1f} ms a row + "
           f"{decode.per_key * 1e6:.1f} us a cached token, +{decode.shared * 1e3:.0f} ms sharing the host "
           f"({decode.samples} runs)") if decode else ""
    return SimProfile(f"fitted:{Path(path).name}", prefill, link, bpt, None, DEFAULT_LATENCY, links,
                      f"calibration of {Path(path).name} ({len(prefill)} workers on one host, "
                      f"{machine.get('cpu')}, {machine.get('cores')} cores){dec}", decode, per_host)


def _gpu(name: str, peak_flops: float, hbm_bytes_s: float, link_bytes_s: float, link_latency: float,
         store_bytes_s: float, source: str) -> SimProfile:
    """Llama-3.1-8B bf16 on one GPU per worker: prefill at 50 % MFU, a step reads the weights once."""
    params, layers, q_heads, kv_heads, head_dim = 8.0e9, 32, 32, 8, 128
    flops = 0.5 * peak_flops
    b = 2 * params / flops  # s per token: 2 FLOP per parameter
    c = 4 * layers * q_heads * head_dim / flops  # s per query-key pair: QK^T and PV
    a = 2 * params / hbm_bytes_s  # s per step: bf16 weights read once
    bpt = kv_bytes_per_token(layers, kv_heads, head_dim, 2)
    return SimProfile(name, (PrefillProfile(a, b, c),), LinkProfile(0.85 * link_bytes_s, link_latency), bpt,
                      StoreProfile(store_bytes_s), 0.002, {}, source)


PRESETS = {
    "h200-nvlink": lambda: _gpu("h200-nvlink", 989e12, 4.8e12, 450e9, 0.0005, 6e9,
                                "MODELED: H200 (989 TFLOP/s bf16, 4.8 TB/s HBM), NVLink 450 GB/s per direction, "
                                "Llama-3.1-8B bf16"),
    "a100-ib200": lambda: _gpu("a100-ib200", 312e12, 2.0e12, 25e9, 0.002, 3e9,
                               "MODELED: A100-80GB (312 TFLOP/s bf16, 2.0 TB/s HBM), 200 Gb/s InfiniBand, "
                               "Llama-3.1-8B bf16"),
}


def preset_profile(name: str) -> SimProfile:
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]()
