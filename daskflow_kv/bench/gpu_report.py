"""The GPU check's result file and verdicts: pure functions over plain data, no GPU needed.

``GpuReport`` is the one document ``gpu_check`` fills phase by phase and rewrites after
every phase (atomically), so a run cut short by its time limit still leaves what it
measured. ``verdict`` turns the measurements into the issue's targets (all agreement checks
pass, KV transfer >= 0.9x a CuPy array of the same bytes over UCX, no host staging).
``parse_ucx_proto`` reads the protocol tables UCX prints with ``UCX_PROTO_INFO=y``: which
transports carried messages whose memory was CUDA (cuda_ipc: device to device).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

from . import provenance

SCHEMA = 1
TARGETS = {"agree": True, "min_cupy_ratio": 0.9, "host_staging": False}


def _clean(x):
    """JSON-safe: NaN/inf become None, tuples lists, unknown objects strings."""
    if isinstance(x, float):
        return None if (math.isnan(x) or math.isinf(x)) else x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_clean(v) for v in (sorted(x) if isinstance(x, (set, frozenset)) else x)]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


class GpuReport:
    """``benchmarks/results/gpu_h200.json`` in the making; every ``save`` is a complete file."""

    __slots__ = ("path", "doc")

    def __init__(self, path: str | os.PathLike, command: str = ""):
        self.path = Path(path)  # where the JSON goes (rewritten whole after each phase)
        self.doc: dict = {  # the document; top-level fields are the issue's
            "schema": SCHEMA,
            "status": "running",
            "command": command,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "protocol": None,
            "agree": None,
            "transfer_gbps": None,
            "cupy_gbps": None,
            "tcp_gbps": None,
            "host_staging": None,
            "timings": {"phases": {}},
            "agreement": {},
            "transfer": [],
            "frame_counts": {},
            "errors": [],
            "targets": TARGETS,
        }

    def set(self, **fields) -> None:
        self.doc.update(fields)
        self.save()

    def phase(self, name: str, seconds: float, **fields) -> None:
        """Record a finished phase: its wall time and whatever it measured."""
        self.doc["timings"]["phases"][name] = seconds
        self.doc.update(fields)
        self.save()

    def error(self, phase: str, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        self.doc["errors"].append({"phase": phase, "error": text[-2000:]})
        self.save()

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(_clean(provenance.stamp(self.doc)), indent=2) + "\n")
        os.replace(tmp, self.path)  # readers never see half a file
        return self.path


# -- verdicts --------------------------------------------------------------------------------
def all_agree(agreement: dict) -> bool | None:
    """True if every check in ``{group: {check: bool}}`` passed; None if none ran."""
    flags = [v for group in agreement.values() for v in group.values() if isinstance(v, bool)]
    return all(flags) if flags else None


def median(xs) -> float:
    xs = sorted(x for x in xs if isinstance(x, (int, float)) and not math.isnan(x))
    if not xs:
        return math.nan
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def headline_gbps(rows: list[dict], kind: str, protocol: str, size_mib: int | None = None) -> float:
    """Median GB/s of ``kind`` over ``protocol`` at ``size_mib`` (default: the largest measured)."""
    sel = [r for r in rows if r.get("kind") == kind and r.get("protocol") == protocol]
    if size_mib is None:
        sizes = [r["size_mib"] for r in sel if r.get("size_mib") is not None]
        if not sizes:
            return math.nan
        size_mib = max(sizes)
    return median(r.get("gbps") for r in sel if r.get("size_mib") == size_mib)


def host_staging(ucx_counts: dict | None, ucx_proto: dict | None) -> bool | None:
    """Did any CUDA tensor go through host memory while moving over UCX?

    From the serializers' counts (every worker, summed) and, when UCX's protocol tables were
    captured, from UCX itself (a large CUDA message not carried by cuda_ipc is staged by
    UCX through host or copy buffers). None when nothing was measured.
    """
    verdicts = []
    if ucx_counts:
        if ucx_counts.get("host_staged_sent", 0) or ucx_counts.get("host_received", 0):
            return True
        if ucx_counts.get("device_received", 0):  # else no CUDA tensor arrived: nothing proven
            verdicts.append(False)
    if ucx_proto and ucx_proto.get("cuda_tables"):
        verdicts.append(not ucx_proto.get("cuda_ipc_large", False))
    return any(verdicts) if verdicts else None


def verdict(doc: dict) -> dict:
    """The issue's targets, each True / False / None (not measured)."""
    ratio = doc.get("cupy_ratio")
    return {
        "agree": doc.get("agree"),
        "cupy_ratio_ge_0.9": None if ratio is None or (isinstance(ratio, float) and math.isnan(ratio))
        else ratio >= TARGETS["min_cupy_ratio"],
        "no_host_staging": None if doc.get("host_staging") is None else not doc["host_staging"],
    }


# -- UCX protocol tables -----------------------------------------------------------------------
_MEM = re.compile(r"\b(?:from|into)\s+(cuda-managed|cuda|rocm-managed|rocm|host|ze-host|ze-device|ze-managed)\b")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/[\w:.\-]+")


def _cells(line: str) -> list[str] | None:
    i = line.find("|")
    if i < 0:
        return None
    body = line[i:].rstrip()
    if not body.endswith("|"):
        return None
    return [c.strip() for c in body.strip("|").split("|")]


def parse_ucx_proto(text: str) -> dict:
    """Summarize ``UCX_PROTO_INFO=y`` tables: the transports that carried CUDA memory.

    A table is a header row ``| <endpoint config> | <operation> from <memory> ... |``
    followed by rows ``| <size range> | <protocol> | <transport/device ...> |``. Returns
    the number of tables, of tables whose memory is CUDA, the transports seen in those,
    whether cuda_ipc carries the largest messages of every CUDA table (``cuda_ipc_large``),
    and a few sample rows.
    """
    tables, current = [], None
    for line in text.splitlines():
        cells = _cells(line)
        if cells is None:
            continue
        if len(cells) == 2:
            m = _MEM.search(cells[1])
            current = {"config": cells[0], "operation": cells[1], "memory": m.group(1) if m else None, "rows": []}
            tables.append(current)
        elif len(cells) == 3 and current is not None:
            current["rows"].append(tuple(cells))
    cuda = [t for t in tables if t["memory"] in ("cuda", "cuda-managed") and t["rows"]]
    transports = sorted({m for t in cuda for r in t["rows"] for m in _TRANSPORT.findall(r[2])})
    return {
        "tables": len(tables),
        "cuda_tables": len(cuda),
        "cuda_transports": transports,
        "cuda_ipc_seen": "cuda_ipc" in transports,
        "cuda_ipc_large": bool(cuda) and all("cuda_ipc" in t["rows"][-1][2] for t in cuda),
        "large_message_rows": sorted({f"{t['operation']}: {' | '.join(t['rows'][-1])}" for t in cuda})[:12],
    }


def read_ucx_logs(directory: str | os.PathLike | None) -> dict | None:
    """``parse_ucx_proto`` over every file in ``directory`` (UCX_LOG_FILE=<dir>/ucx.%p.log)."""
    if not directory or not Path(directory).is_dir():
        return None
    files = sorted(p for p in Path(directory).iterdir() if p.is_file())
    text = "\n".join(p.read_text(errors="replace") for p in files)
    out = parse_ucx_proto(text)
    out["log_files"] = len(files)
    return out
