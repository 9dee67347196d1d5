"""Plumbing shared by the benchmarks: machine info, result files, progress, statistics.

Nothing here knows about KV state. Every benchmark writes its results through
``write_json``, which stamps them with their provenance (``provenance.stamp``: the commit,
the host, the libraries, the command and its wall time).
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from . import provenance

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def summary_file(out_dir: Path, tag: str) -> Path:
    """Where a bench run's markdown summary goes unless --summary says: SUMMARY.md for the full profile."""
    return Path(out_dir) / ("SUMMARY.md" if tag == "full" else f"SUMMARY_{tag}.md")


def command_line(prog: str | None = None, argv: Sequence[str] | None = None) -> str:
    """The command as typed (``prog`` replaces argv[0], e.g. ``daskflow-kv bench``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    head = prog or " ".join([os.path.basename(sys.executable), *sys.argv[:1]])
    return " ".join([head, *(shlex.quote(a) for a in args)])


def machine_info() -> dict:
    """CPU, cores, memory, load and library versions: enough to judge a timing. ``host_id``
    is the host's fingerprint (``provenance.host``), the same in every process; ``commit``
    the checkout's HEAD, read here, at the run's start (``provenance.git_state``)."""
    import dask
    import distributed
    import torch
    import transformers

    try:
        import psutil

        mem = psutil.virtual_memory().total
    except Exception:  # noqa: BLE001 -- psutil is a distributed dependency; info is optional anyway
        mem = None
    return {
        "cpu": provenance.host()["cpu"],
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "host_id": provenance.host()["id"],
        "commit": provenance.git_state()["commit"],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _clean(x):
    """JSON-safe: NaN/inf become None, tuples lists, unknown objects strings."""
    if isinstance(x, float):
        return None if (math.isnan(x) or math.isinf(x)) else x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def write_json(path: Path, doc: dict) -> Path:
    """``doc`` as JSON at ``path``, stamped with its provenance (``provenance.stamp``)."""
    provenance.stamp(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(doc), indent=2))
    return path


def write_csv(path: Path, rows: Iterable[dict]) -> Path:
    rows = list(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_cell(r.get(k)) for k in cols})
    return path


def _csv_cell(v):
    if isinstance(v, float):
        return "" if (math.isnan(v) or math.isinf(v)) else f"{v:.6g}"
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(_clean(v))
    return "" if v is None else v


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """How long at least one of ``intervals`` (start, stop) was running: their union's length.

    A worker's model compute: requests its step loop batched together overlap, and summing
    them counts a shared step once per request (text replay's 16 prompts summed to 6x the
    wall, and Omega = wall - busiest compute came out at -282 s)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def mib(n: float) -> float:
    return n / 2**20


class Progress:
    """tqdm when it is installed, a line per step otherwise."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.n, self.enabled = total, desc, 0, enabled
        self._t0 = time.perf_counter()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, leave=True, dynamic_ncols=True)
            except ImportError:
                print(f"[{desc}] 0/{total}", flush=True)

    def step(self, note: str = "") -> None:
        self.n += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(note[:60])
            self._bar.update(1)
        else:
            print(f"[{self.desc}] {self.n}/{self.total} {note} ({time.perf_counter() - self._t0:.0f}s)", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def log(msg: str) -> None:
    print(msg, flush=True)
