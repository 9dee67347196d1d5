"""CUDA KV blocks between two GPU workers over UCX: device buffers end to end, no host staging.

GPU machines with the ``gpu-cu12`` / ``gpu-cu13`` extra only (skipped elsewhere; the counting
rules themselves are tested on CPU in test_gpu_check.py). ``cuda_cluster()`` puts two workers
on device 0 of a one-GPU machine, so blocks cross processes by CUDA IPC. Every CUDA tensor's
path is counted by the serializers (``runtime.frame_counts``) in every process; a host path
anywhere fails the test. The TCP cluster is the positive control: there the same counters
must see the host staging, or they prove nothing.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from distributed import wait

from daskflow_kv.transport import frame_counts as fc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _stack():
    for mod in ("cupy", "dask_cuda", "distributed_ucxx"):
        pytest.importorskip(mod)


def make_block(shape, dtype_name, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda").to(getattr(torch, dtype_name))


def fingerprint(x) -> dict:
    """On the receiving worker: is it a CUDA tensor, over device memory the comm allocated?"""
    from distributed import get_worker

    raw = x.contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return {"worker": get_worker().address, "is_cuda": x.is_cuda, "dtype": str(x.dtype),
            "sha": hashlib.sha256(raw).hexdigest()}


def _held_on_device(keys, dask_worker=None) -> list[bool]:
    return [bool(dask_worker.data[k].is_cuda) for k in keys if k in dask_worker.data]


@pytest.fixture(scope="module", params=["ucx", "tcp"])
def gpu_client(request):
    _stack()
    from distributed import Client

    from daskflow_kv.runtime.cluster import cuda_cluster

    with cuda_cluster(protocol=request.param, dashboard_address=None) as cluster, Client(cluster) as client:
        yield request.param, client


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_block_moves_device_to_device(gpu_client, dtype_name):
    protocol, client = gpu_client
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    assert len(workers) == 2 and all(w.startswith(protocol) for w in workers)
    a, b = workers
    shape = (16, 2, 8, 256, 64)  # a 1B-model KV block of 256 tokens (16 MiB in bf16)
    block = client.submit(make_block, shape, dtype_name, 7, workers=[a], pure=False)
    wait([block])  # made on a; nothing moved yet
    client.run(fc.reset)
    got = client.submit(fingerprint, block, workers=[b], allow_other_workers=False, pure=False).result()
    counts = client.run(fc.snapshot)
    expected = client.submit(fingerprint, block, workers=[a], pure=False).result()
    assert got["worker"] == b and got["is_cuda"] and got["sha"] == expected["sha"]
    nbytes = torch.Size(shape).numel() * getattr(torch, dtype_name).itemsize
    if protocol == "ucx":
        # Sent as a device buffer by a, rebuilt on b from the device buffer UCX delivered.
        assert counts[a]["device_sent"] >= 1 and counts[a]["device_sent_bytes"] >= nbytes, counts
        assert counts[b]["device_received"] >= 1 and counts[b]["device_received_bytes"] >= nbytes, counts
        assert not any(fc.host_path_taken(c) for c in counts.values()), counts
    else:
        # TCP cannot carry device memory: the counters must see the staging (positive control).
        assert counts[a]["host_staged_sent"] >= 1 and counts[b]["host_received"] >= 1, counts
        assert fc.host_path_taken(counts[a]) and fc.host_path_taken(counts[b])


def test_kv_runtime_transfer_keeps_blocks_on_device(gpu_client):
    """A real state's blocks, forced to move a -> b by the planner: CUDA tensors on b, no host path on UCX."""
    protocol, client = gpu_client
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    a, b = sorted(client.scheduler_info(n_workers=-1)["workers"])
    rt = KVRuntime(client, "tiny-llama", dtype="bfloat16", block_size=16, device="cuda")
    ctx = rt.encode("The shared context is prefilled once and every agent resumes from the same cache. " * 3)
    root = rt.materialize(ctx, worker=a)
    rt.wait([root])
    client.run(fc.reset)
    sufs = [rt.encode(" First?"), rt.encode(" Second, longer question?")]
    gens = rt.resume_many([(root, s) for s in sufs], max_new_tokens=6, policy="transfer", workers=[b])
    counts = client.run(fc.snapshot)
    want = [rt.generate_text(ctx + s, 6, worker=a).result().generated for s in sufs]
    assert [g.tokens for g in gens] == want
    assert all(g.worker == b and g.placement.action == "transfer" for g in gens)
    on_b = client.run(_held_on_device, keys=list(root.state.block_keys), workers=[b])[b]
    assert on_b and all(on_b), on_b  # the moved prefix blocks are CUDA tensors in b's memory
    if protocol == "ucx":
        assert counts[b]["device_received"] >= 1, counts
        assert not any(fc.host_path_taken(c) for c in counts.values()), counts
    else:
        assert counts[b]["host_received"] >= 1, counts
