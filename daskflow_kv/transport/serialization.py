"""Zero-copy Dask serialization and true ``sizeof`` for torch tensors (KV blocks).

Why this module exists (distributed 2026.8):

* distributed's default torch serializer goes through ``Tensor.numpy()``, so bf16 tensors
  (no numpy dtype) and CUDA tensors fail to serialize.
* ``dask.sizeof`` does not know torch tensors and reports ~80 bytes for a 64 MiB block,
  so the scheduler would think KV is free to move and never spill it.

Wire format ("dask" family): the header carries dtype name, shape, strides, device and
requires_grad; the data frame is a uint8 memoryview over the tensor's contiguous storage
(after an empty "spacer" frame that keeps it aligned on arrival, see ``_spacer``).
The bytes are never copied on the send side, and on the receive side the tensor aliases the
received frame.  Every dtype (bf16, fp8, bool, ...) travels the same way as raw bytes and is
reinterpreted with ``Tensor.view(dtype)``; nothing depends on numpy knowing the dtype.

CUDA tensors: with CuPy installed, a "cuda"-family serializer hands UCX the device buffer
(through ``cupy.asarray`` / DLPack), so GPU-to-GPU moves stay on the device.  Over TCP
(the "dask" family) a CUDA tensor is staged through host memory (one device->host copy
on send) and moved back to the receiver's current CUDA device on arrival -- or left on the
host if the receiving process has no CUDA.

Every CUDA tensor serialized or rebuilt here is counted in ``frame_counts.COUNTS`` by the
path it took (device buffer or host bytes): the evidence that GPU-to-GPU moves over UCX
never stage through host memory (``frame_counts.host_path_taken``).

Registration must happen in *every* process that sends or receives tensors (client,
workers).  Importing this module registers; workers get it through the scheduler plugin's
``plugins.worker.TorchSerializationPlugin`` (or ``--preload`` of this module).
A process without it falls back to distributed's defaults, which cannot read our header.
"""

from __future__ import annotations

import distributed.protocol.torch  # noqa: F401  -- must precede our registration, see below
import torch
from dask.sizeof import sizeof
from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from .frame_counts import COUNTS, DEVICE, HOST, frame_kind

try:  # optional: only GPU installs have CuPy
    import cupy
except ImportError:  # pragma: no cover - depends on the install
    cupy = None

__all__ = ["register_torch_serialization", "sizeof_torch_tensor"]

_SIZEOF_OVERHEAD = 64  # bytes for the Python object + TensorImpl; small and constant


def sizeof_torch_tensor(t: torch.Tensor) -> int:
    return t.element_size() * t.nelement() + _SIZEOF_OVERHEAD


def _check_supported(t: torch.Tensor, devices: tuple[str, ...]) -> None:
    # NotImplementedError makes distributed.serialize() fall through to the next family
    # ("pickle"), which keeps subclasses, sparse/nested/quantized tensors working as before.
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested:
        raise NotImplementedError(type(t))
    if t.is_quantized or t.device.type not in devices:
        raise NotImplementedError(t.device)


def _prepare(t: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Header plus a contiguous, gradient-free tensor whose storage is sent as is."""
    header = {
        "dtype": str(t.dtype).removeprefix("torch."),
        "device": t.device.type,
        "requires_grad": t.requires_grad,
    }
    # .contiguous() copies only when the tensor is not contiguous already (a transposed
    # or sliced view); conj/neg bits are lazy flags that must be materialized first.
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    header["shape"] = tuple(t.shape)
    header["strides"] = tuple(t.stride())
    return header, t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # A 1-d uint8 view of the storage: same memory, any dtype (0-d gives one element).
    return t.reshape(-1).view(torch.uint8)


def _rebuild(flat_u8: torch.Tensor, header: dict) -> torch.Tensor:
    dtype = getattr(torch, header["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"not a torch dtype: {header['dtype']!r}")
    t = flat_u8.view(dtype).as_strided(header["shape"], header["strides"])
    return t.requires_grad_(header["requires_grad"])


def _spacer() -> memoryview:
    """An empty frame sent in front of the data frame, so that TCP lands the data aligned.

    distributed's TCP comm reads the message header *and the first uncompressed buffer*
    into one allocation, so that buffer starts at an arbitrary byte offset; numpy copes
    with misaligned arrays, torch does not (see the alignment copy in deserialize).  An
    empty bytearray-backed frame becomes that "first buffer", and the data frame gets its
    own, aligned receive buffer.  Costs nothing on the wire.
    """
    return memoryview(bytearray())


def serialize_torch_tensor(t: torch.Tensor) -> tuple[dict, list]:
    _check_supported(t, ("cpu", "cuda"))
    header, data = _prepare(t)
    if data.device.type == "cuda":
        data = data.cpu()  # TCP can only carry host memory: one staging copy
        COUNTS.record_sent(HOST, data.nbytes)
    # .numpy() shares memory: the data frame aliases the tensor (zero-copy).
    frames = [_spacer(), memoryview(_as_bytes(data).numpy())]
    if t.grad is not None:
        header["grad"], grad_frames = serialize_torch_tensor(t.grad)
        frames += grad_frames
    return header, frames


def deserialize_torch_tensor(header: dict, frames: list) -> torch.Tensor:
    frame = memoryview(frames[1]).cast("B")  # frames[0] is the spacer
    if frame.nbytes == 0:
        flat = torch.empty(0, dtype=torch.uint8)  # frombuffer rejects empty buffers
    elif frame.readonly:
        # Unavoidable copy: tensors are always writable, and frombuffer on a read-only
        # buffer would hand out a tensor whose writes are undefined behaviour.  Happens
        # only for `bytes` frames (e.g. spilled data decompressed by zlib/snappy/zstd);
        # TCP and spill-to-disk without compression give writable buffers.
        flat = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    else:
        flat = torch.frombuffer(frame, dtype=torch.uint8)  # aliases the frame: zero-copy
        if flat.data_ptr() % getattr(torch, header["dtype"]).itemsize:
            # Unavoidable copy: torch kernels assume aligned elements (misaligned data is
            # undefined behaviour: SIGBUS/garbage, pytorch#190043).  Rare thanks to the
            # spacer; still happens for frames cut out of one buffer (spill files).
            flat = flat.clone()
    t = _rebuild(flat, header)
    if header["device"] == "cuda":
        COUNTS.record_received(HOST, frame.nbytes)  # a CUDA tensor that crossed as host bytes
        if torch.cuda.is_available():
            t = t.to("cuda")  # the receiver's current device (dask-cuda pins one per worker)
    if "grad" in header:
        t.grad = deserialize_torch_tensor(header["grad"], frames[2:])
    return t


if cupy is not None:

    def cuda_serialize_torch_tensor(t: torch.Tensor) -> tuple[dict, list]:
        _check_supported(t, ("cuda",))  # host tensors fall through to the "dask" family
        if t.grad is not None:
            raise NotImplementedError("grad")  # let the "dask" family handle it
        header, data = _prepare(t)
        # __cuda_array_interface__: a CuPy uint8 array over the same device memory.
        frame = cupy.asarray(_as_bytes(data))
        COUNTS.record_sent(DEVICE, frame.nbytes)
        return header, [frame]

    def cuda_deserialize_torch_tensor(header: dict, frames: list) -> torch.Tensor:
        frame = frames[0]
        if frame_kind(frame) == HOST:
            # A comm that delivered host bytes for a device frame: one host-to-device copy,
            # counted, so a check that demands a device path fails loudly.
            raw = bytearray(memoryview(frame).cast("B"))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            COUNTS.record_received(HOST, flat.nbytes)
            return _rebuild(flat.to("cuda"), header)
        # The frame is whatever device buffer the comm allocated (RMM DeviceBuffer, CuPy or
        # Numba array); CuPy wraps it without copying and DLPack hands it to torch.
        flat = torch.from_dlpack(cupy.asarray(frame).view(cupy.uint8).ravel())
        COUNTS.record_received(DEVICE, flat.nbytes)
        return _rebuild(flat, header)


def register_torch_serialization() -> None:
    """(Re-)register the serializers and sizeof above; idempotent and cheap.

    distributed registers its own torch serializer lazily, the first time any torch type
    is dispatched (e.g. a ``torch.nn.Parameter`` walks its MRO and triggers it), which
    would silently replace ours.  Importing ``distributed.protocol.torch`` first (top of
    this module) runs that registration now, so ours is the one that stays.
    """
    dask_serialize.register(torch.Tensor, serialize_torch_tensor)
    dask_deserialize.register(torch.Tensor, deserialize_torch_tensor)
    if cupy is not None:
        cuda_serialize.register(torch.Tensor, cuda_serialize_torch_tensor)
        cuda_deserialize.register(torch.Tensor, cuda_deserialize_torch_tensor)
    sizeof.register(torch.Tensor, sizeof_torch_tensor)


register_torch_serialization()
