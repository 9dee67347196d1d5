"""Zero-copy torch tensor serialization and sizeof (daskflow_kv.transport.serialization)."""

from __future__ import annotations

import hashlib
import warnings

import numpy as np
import pytest
import torch
from dask.sizeof import sizeof
from distributed import Client, LocalCluster, get_worker
from distributed.protocol import (
    deserialize,
    deserialize_bytes,
    dumps,
    loads,
    serialize,
    serialize_bytelist,
    to_serialize,
)
from distributed.protocol.serialize import dask_serialize

from daskflow_kv.plugins.worker import TorchSerializationPlugin
from daskflow_kv.transport.serialization import register_torch_serialization, serialize_torch_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _kv_block(dtype, shape=(2, 2, 3, 16, 8), seed=0):
    # [num_layers, 2, kv_heads, block_tokens, head_dim], like a real KV block
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def _bits(t):
    """Raw bytes of a tensor; bf16/fp16 compared bit for bit, never through floats."""
    t = t.detach().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _addr(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def _roundtrip_serialize(t):
    header, frames = serialize(t)
    assert header["serializer"] == "dask"
    return deserialize(header, frames)


def _roundtrip_dumps(t):
    # The full message path used by comms: frames -> (bytes on the wire) -> message.
    frames = dumps({"x": to_serialize(t)})
    frames = [bytearray(f) for f in frames]  # as a TCP read delivers them: writable
    return loads(frames)["x"]


@pytest.mark.parametrize("roundtrip", [_roundtrip_serialize, _roundtrip_dumps])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: t, id="contiguous"),
        pytest.param(lambda t: t.transpose(-1, -2), id="transposed"),
        pytest.param(lambda t: t[:, 1, :, ::2], id="strided-slice"),
        pytest.param(lambda t: t[0, 0, 0, 0, 0], id="0d"),
        pytest.param(lambda t: t[:, :, :, :0], id="empty"),
    ],
)
def test_roundtrip_bit_exact(roundtrip, dtype, make):
    t = make(_kv_block(dtype))
    u = roundtrip(t)
    assert type(u) is torch.Tensor
    assert u.dtype == t.dtype and u.shape == t.shape and u.device == t.device
    assert _bits(u) == _bits(t)
    u.add_(1)  # deserialized tensors are writable (and no warning was needed)


def test_requires_grad_and_grad_survive():
    t = torch.randn(3, 4, requires_grad=True)
    (t * 2).sum().backward()
    u = _roundtrip_dumps(t)
    assert u.requires_grad and u.is_leaf
    assert torch.equal(u.detach(), t.detach())
    assert torch.equal(u.grad, t.grad)
    p = _roundtrip_serialize(torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)))
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad


def test_serialized_frame_aliases_tensor():
    t = _kv_block(torch.bfloat16)
    header, frames = serialize(t)
    spacer, frame = frames
    assert spacer.nbytes == 0
    assert isinstance(frame, memoryview) and frame.nbytes == t.nelement() * 2
    assert _addr(frame) == t.data_ptr()  # no copy on the send side
    assert np.shares_memory(np.asarray(frame), t.view(torch.int16).numpy())
    assert header["sub-header"]["dtype"] == "bfloat16"
    wire = dumps({"x": to_serialize(t)})  # the message frames a comm writes
    assert any(memoryview(f).nbytes and _addr(f) == t.data_ptr() for f in wire)


def test_deserialized_tensor_aliases_writable_frame():
    t = _kv_block(torch.bfloat16)
    header, frames = serialize(t)
    buf = bytearray(frames[1])  # a receive buffer, as TCP hands it to deserialize
    u = deserialize(header, [frames[0], buf])
    assert u.data_ptr() == _addr(buf)  # no copy on the receive side
    buf[0] ^= 0xFF  # writes to the frame show up in the tensor: same memory
    assert u.view(torch.int16).flatten()[0].item() != t.view(torch.int16).flatten()[0].item()


def test_readonly_and_misaligned_frames_are_copied_correctly():
    t = _kv_block(torch.float32)
    header, frames = serialize(t)
    raw = bytes(frames[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.frombuffer warns on read-only buffers
        u = deserialize(header, [b"", raw])
    assert u.data_ptr() != _addr(raw) and _bits(u) == _bits(t)
    u.add_(1)
    odd = memoryview(bytearray(b"\0" + raw))[1:]  # starts at an odd address
    v = deserialize(header, [b"", odd])
    assert v.data_ptr() % 4 == 0 and _bits(v) == _bits(t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64], ids=str)
def test_tcp_delivers_aligned_frame_without_copy(dtype):
    # Over real TCP the data frame must arrive in its own aligned buffer (the spacer's job),
    # so the received tensor aliases the receive buffer instead of being re-copied.
    import asyncio

    from distributed.comm import connect, listen

    t = _kv_block(dtype, shape=(2, 2, 3, 256, 32))  # > 128 KiB: not coalesced

    async def main():
        received = asyncio.get_running_loop().create_future()

        async def handler(comm):
            received.set_result(await comm.read())
            await comm.close()

        # deserialize=False: keep the frames exactly as the comm received them
        async with listen("tcp://127.0.0.1:0", handler, deserialize=False) as listener:
            comm = await connect(listener.contact_address)
            await comm.write({"pad": "x" * 13, "x": to_serialize(t)})  # odd header length
            msg = await received
            await comm.close()
        return msg["x"]

    ser = asyncio.run(main())
    frame = ser.frames[1]
    assert _addr(frame) % 16 == 0
    u = deserialize(ser.header, ser.frames)
    assert u.data_ptr() == _addr(frame)  # aliases the receive buffer: no copy
    assert _bits(u) == _bits(t)


def test_spill_roundtrip():
    # What a worker does when it spills a block to disk and reads it back.
    t = _kv_block(torch.bfloat16)
    frames = serialize_bytelist(t, on_error="raise")
    u = deserialize_bytes(bytearray(b"".join(frames)))
    assert _bits(u) == _bits(t)


def test_subclasses_fall_back_to_pickle():
    class Tagged(torch.Tensor):
        pass

    t = torch.ones(3).as_subclass(Tagged)
    header, frames = serialize(t, serializers=("dask", "pickle"))
    assert header["serializer"] == "pickle"


def test_registration_survives_lazy_defaults():
    # Dispatching any other torch type (Parameter) runs distributed's lazy torch
    # registration; it must not replace ours.
    serialize(torch.nn.Parameter(torch.ones(1)))
    register_torch_serialization()
    assert dask_serialize.dispatch(torch.Tensor) is serialize_torch_tensor


def test_sizeof_is_true_bytes():
    t = torch.empty(4, 2, 3, 16, 64, dtype=torch.bfloat16)
    assert t.nelement() * 2 <= sizeof(t) < t.nelement() * 2 + 1024
    assert sizeof(t[:, 0]) < sizeof(t)


# ---------------------------------------------------------------- CUDA (GPU machines only)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_tensor_over_tcp_goes_through_host(dtype):
    t = _kv_block(dtype).cuda().transpose(-1, -2)
    header, frames = serialize(t, serializers=("dask",))
    assert all(isinstance(f, memoryview) for f in frames)  # host bytes, TCP can carry them
    u = deserialize(header, frames)
    assert u.is_cuda and _bits(u.cpu()) == _bits(t.cpu())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_family_is_zero_copy_on_device(dtype):
    cupy = pytest.importorskip("cupy")
    t = _kv_block(dtype).cuda()
    header, frames = serialize(t, serializers=("cuda", "dask", "pickle"))
    assert header["serializer"] == "cuda"
    (frame,) = frames
    assert isinstance(frame, cupy.ndarray) and frame.data.ptr == t.data_ptr()  # no copy
    u = deserialize(header, [cupy.asarray(frame).copy()])  # as UCX delivers: a new buffer
    assert u.is_cuda and torch.equal(u.view(torch.uint8), t.view(torch.uint8))
    cpu = torch.ones(3)  # host tensors fall through to the "dask" family
    assert serialize(cpu, serializers=("cuda", "dask"))[0]["serializer"] == "dask"


# ---------------------------------------------------------------- real cluster


def _fingerprint_on_worker(x):
    t = x.contiguous().view(torch.int16) if x.dtype == torch.bfloat16 else x
    return get_worker().address, str(x.dtype), hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _make_block(numel):
    return torch.arange(numel, dtype=torch.float32).to(torch.bfloat16)


def _scheduler_nbytes(key, dask_scheduler=None):
    return dask_scheduler.tasks[key].nbytes


@pytest.fixture(scope="module")
def client():
    with LocalCluster(
        n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None
    ) as cluster, Client(cluster) as c:
        c.register_plugin(TorchSerializationPlugin())
        c.register_plugin(TorchSerializationPlugin())  # idempotent
        yield c


def test_cluster_moves_bf16_block_bit_exact(client):
    a, b = sorted(client.scheduler_info()["workers"])
    t = _kv_block(torch.bfloat16, shape=(2, 2, 3, 64, 32), seed=1)
    fut = client.scatter(t, workers=[a])
    got = client.submit(_fingerprint_on_worker, fut, workers=[b], pure=False).result()
    assert got == (b, "torch.bfloat16", hashlib.sha256(_bits(t)).hexdigest())
    true_bytes = t.nelement() * t.element_size()
    nbytes = client.run_on_scheduler(_scheduler_nbytes, fut.key)
    assert true_bytes <= nbytes < true_bytes + 1024
    assert _bits(fut.result()) == _bits(t)  # and back to the client


def test_cluster_task_result_sizeof_and_transfer(client):
    # A block produced by a task: sizeof runs in the worker process (plugin/import).
    a, b = sorted(client.scheduler_info()["workers"])
    numel = 1 << 20
    block = client.submit(_make_block, numel, workers=[a], pure=False)
    got = client.submit(_fingerprint_on_worker, block, workers=[b], pure=False).result()
    expected = _make_block(numel)
    assert got == (b, "torch.bfloat16", hashlib.sha256(_bits(expected)).hexdigest())
    nbytes = client.run_on_scheduler(_scheduler_nbytes, block.key)
    assert 2 * numel <= nbytes < 2 * numel + 1024
