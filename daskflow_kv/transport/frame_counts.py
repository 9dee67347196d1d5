"""Which path every CUDA tensor took through the serializers: device buffers or host bytes.

The GPU half of the design promises that a KV block moving between two GPU workers over
UCX never touches host memory: the "cuda" serializer family hands the comm the tensor's own
device buffer, and the comm delivers a device buffer on the other side. This module is the
evidence. ``serialization.py`` records every CUDA tensor it serializes or rebuilds, as one
of two paths:

* device: sent as a device buffer ("cuda" family), or rebuilt from a frame that is itself
  device memory (it has ``__cuda_array_interface__``);
* host:   copied to host memory to be sent ("dask" family: TCP, spill to host), or rebuilt
  from host bytes (one host-to-device copy).

Pure bookkeeping, no torch and no CUDA, so the counting rules are tested on any machine.
Each process has one ``COUNTS``; ``snapshot`` / ``reset`` are ``client.run`` targets, so a
check reads every worker's counts and fails if any CUDA tensor took a host path.
"""

from __future__ import annotations

import threading

DEVICE = "device"  # the frame is GPU memory
HOST = "host"  # the frame is host memory

FIELDS = (
    "device_sent",
    "device_sent_bytes",
    "host_staged_sent",
    "host_staged_sent_bytes",
    "device_received",
    "device_received_bytes",
    "host_received",
    "host_received_bytes",
)


def frame_kind(frame) -> str:
    """``DEVICE`` for a buffer in GPU memory (CuPy, RMM, Numba: ``__cuda_array_interface__``), else ``HOST``."""
    return DEVICE if hasattr(frame, "__cuda_array_interface__") else HOST


class FrameCounts:
    """Per-process tally of the paths CUDA tensors took; thread-safe (comm threads, offload)."""

    __slots__ = (*FIELDS, "_lock")

    def __init__(self):
        self.device_sent = 0  # CUDA tensors handed to a comm as device buffers
        self.device_sent_bytes = 0  # their bytes
        self.host_staged_sent = 0  # CUDA tensors copied to host memory to be sent or spilled
        self.host_staged_sent_bytes = 0  # their bytes
        self.device_received = 0  # CUDA tensors rebuilt from device frames, no copy
        self.device_received_bytes = 0  # their bytes
        self.host_received = 0  # CUDA tensors rebuilt from host bytes (host-to-device copy)
        self.host_received_bytes = 0  # their bytes
        self._lock = threading.Lock()  # guards the counters

    def record_sent(self, kind: str, nbytes: int) -> None:
        """A CUDA tensor left this process as ``kind`` (DEVICE: its own buffer; HOST: a staged copy)."""
        with self._lock:
            if kind == DEVICE:
                self.device_sent += 1
                self.device_sent_bytes += nbytes
            else:
                self.host_staged_sent += 1
                self.host_staged_sent_bytes += nbytes

    def record_received(self, kind: str, nbytes: int) -> None:
        """A CUDA tensor was rebuilt here from a frame of ``kind``."""
        with self._lock:
            if kind == DEVICE:
                self.device_received += 1
                self.device_received_bytes += nbytes
            else:
                self.host_received += 1
                self.host_received_bytes += nbytes

    def snapshot(self) -> dict:
        with self._lock:
            return {f: getattr(self, f) for f in FIELDS}

    def reset(self) -> None:
        with self._lock:
            for f in FIELDS:
                setattr(self, f, 0)


COUNTS = FrameCounts()


def snapshot() -> dict:
    """This process's counts (a ``client.run`` target: one dict per worker)."""
    return COUNTS.snapshot()


def reset() -> None:
    """Zero this process's counts (a ``client.run`` target)."""
    COUNTS.reset()


def host_path_taken(counts: dict) -> bool:
    """True if any CUDA tensor in ``counts`` (one process's snapshot) went through host memory."""
    return bool(counts.get("host_staged_sent", 0) or counts.get("host_received", 0))


def total(per_worker: dict[str, dict]) -> dict:
    """Sum of several processes' snapshots (``client.run(snapshot)``'s answer)."""
    out = dict.fromkeys(FIELDS, 0)
    for counts in per_worker.values():
        for f in FIELDS:
            out[f] += counts.get(f, 0)
    return out


def delta(after: dict[str, dict], before: dict[str, dict]) -> dict[str, dict]:
    """Per-worker counts accumulated between two ``client.run(snapshot)`` answers."""
    return {w: {f: a.get(f, 0) - before.get(w, {}).get(f, 0) for f in FIELDS} for w, a in after.items()}
