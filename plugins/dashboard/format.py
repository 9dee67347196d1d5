"""How the KV page writes numbers and times: bytes, counts, durations, clock times.

Plain functions of one value, used by the page's view (``kv_dashboard_view``) and as
filters of its templates (``kv_dashboard_render``).
"""

from __future__ import annotations

import math
import time


def fmt_bytes(n) -> str:
    """1536 -> '1.5 kB' (powers of 1000, as Prometheus and the JSON count them)."""
    n = float(n or 0)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fmt_int(n) -> str:
    """1462.0 -> '1,462'."""
    return f"{round(float(n or 0)):,}"


def fmt_s(t) -> str:
    """A duration: '–' when unknown, '∞' when infinite, ms below a second."""
    if t is None:
        return "–"
    t = float(t)
    if not math.isfinite(t):
        return "∞"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def fmt_clock(t) -> str:
    """A timestamp as local time with milliseconds: '10:12:35.534'."""
    t = float(t or 0)
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"


def fmt_time(t) -> str:
    """A timestamp as local time: '10:12:35'."""
    return time.strftime("%H:%M:%S", time.localtime(t))
