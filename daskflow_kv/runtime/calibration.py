"""Probes that give the cost model measurements before any workflow has run.

Bandwidth: a real payload of ``probe_bytes`` made on one worker (on the runtime's device:
a GPU cluster measures device-to-device moves) and read by a task on another; the figure is the receiver's own transfer record (Dask's ``transfer_incoming_log``),
not a timer around the call. Prefill: a real prefill of a few sizes on every worker, which
reports its timing to the scheduler plugin like any other prefill.
"""

from __future__ import annotations

import itertools
import random
import time

from distributed import wait

from .. import config, validation
from ..dask_internals import incoming_transfers
from . import tasks


def _transfer_record(dask_worker, key):
    for entry in reversed(incoming_transfers(dask_worker)):
        if key in entry["keys"]:
            return {"total": entry["total"], "duration": entry["duration"], "who": entry["who"]}
    return None


def measure_bandwidth(client, src: str, dst: str, nbytes: int, device: str = "cpu") -> float:
    payload = client.submit(tasks.probe_bytes, nbytes, device, workers=[src], pure=False)
    wait(payload)
    reader = client.submit(tasks.touch, payload, workers=[dst], allow_other_workers=False, pure=False)
    reader.result()
    rec = client.run(_transfer_record, key=payload.key, workers=[dst])[dst]
    del payload, reader
    if rec is None:
        raise RuntimeError(f"no transfer of the probe was recorded on {dst}")
    return rec["total"] / max(rec["duration"], 1e-6)


def measure_prefill(runtime, worker: str, sizes=(32, 128, 256)) -> None:
    rng = random.Random(0)
    for n in sizes:
        n = min(n, runtime.facts.max_positions - 1)
        tokens = [rng.randrange(3, runtime.facts.vocab_size) for _ in range(n)]
        req = tasks.PrefillRequest(tuple(tokens), 0, op="calibrate")
        runtime.client.submit(tasks.prefill, runtime.spec, req, workers=[worker], allow_other_workers=False,
                              pure=False).result()


def calibrate(runtime, probe_bytes: int | str | None = None, probe_tokens: int | None = None) -> dict:
    """Measure every worker pair's bandwidth and every worker's prefill speed."""
    probe_bytes = validation.setting("calibration.probe-bytes", probe_bytes, "probe_bytes", validation.byte_size)
    probe_tokens = validation.setting("calibration.probe-tokens", probe_tokens, "probe_tokens", validation.integer,
                                      minimum=8)  # it also prefills probe_tokens // 8
    client = runtime.client
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    bandwidth = {}
    for src, dst in itertools.permutations(workers, 2):
        bw = measure_bandwidth(client, src, dst, probe_bytes, runtime.spec.device)
        runtime._rpc("kv_record_bandwidth", src=src, dst=dst, bandwidth=bw)
        bandwidth[f"{src}->{dst}"] = bw
    for w in workers:
        measure_prefill(runtime, w, sizes=(probe_tokens // 8, probe_tokens // 2, probe_tokens))
    deadline = time.time() + 10  # worker events reach the scheduler asynchronously
    profiles = runtime._rpc("kv_snapshot")["prefill_profiles"]
    while not all(w in profiles for w in workers) and time.time() < deadline:
        time.sleep(0.05)
        profiles = runtime._rpc("kv_snapshot")["prefill_profiles"]
    return {"bandwidth": bandwidth, "prefill_profiles": profiles}
