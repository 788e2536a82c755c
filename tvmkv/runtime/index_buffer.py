"""One packed int32 buffer for all index arrays of a forward: filled on the host, uploaded in one copy.

``PagedAttentionKVCache.begin_forward`` writes every index array of a step (docs/layout.md, "Page
tables", "Ragged queries", "Token trees") into one preallocated host array, copies the used prefix to
the device in ONE copy, and hands the kernels *views* of the device buffer.

Device buffers form a ring of :data:`RING` slots, used in turn, one per forward. Why a ring: the
upload is issued through TVM's ``TVMTensorCopyFromTo`` (no stream argument: the legacy default
stream), while kernels run on TVM's current stream (by default the same legacy stream, but e.g.
torch's current stream under ``tvm_ffi.use_torch_stream``). With one buffer, step N+1's upload could
overwrite the page table step N's kernels are still reading whenever the two streams differ — the
write-after-read hazard of TVM's own C++ cache, whose aux-data copy stream waits for nothing. With two
slots, step N+1 writes memory step N never reads; reusing step N's slot at step N+2 needs step N to
be finished, which any per-step readback (sampling reads the logits) guarantees. On one stream (the
default) stream order alone already makes every slot reuse safe. We do not allocate per step: a
device free (cudaFree) synchronises the whole device.

Pinned host memory is not available through TVM's Python API (``tvm.runtime.empty`` on the CPU gives
pageable memory), so the upload is a synchronous pageable ``cudaMemcpy``; CUDA stages it and orders
it after earlier work of the legacy stream. The host buffer may therefore be rewritten right after the
call returns.

Views: TVM's ``Tensor._create_view(shape, dtype, relative_byte_offset)`` keeps the offset in
``DLTensor.byte_offset``, which tvmkv's kernels reject (their buffers require ``byte_offset == 0``).
So views are imported through DLPack with the data pointer itself advanced (every array starts on a
64-byte boundary, as TVM's DLPack import and the kernels' buffers expect). Each view's DLPack struct
(``DLManagedTensor`` followed by its shape) is ONE block from C ``malloc`` whose deleter is C ``free``:
the tensor TVM makes from it owns it and frees it when the last reference to the view goes, however
long a caller keeps the view (no Python callback runs from C, and dropping the view cache never
frees a struct a live view still points into). The memory a view points into is owned by the
:class:`IndexBuffers` that made it, which keeps every allocation (retired ones too) until it dies.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

RING = 2  # device slots used in turn (see the module docstring)
ALIGN = 16  # int32 elements = 64 bytes
_BUCKET = 1024  # uploads copy the used prefix rounded up to this many elements (bounded view cache)
_MAX_VIEWS = 512  # view cache entries per slot before it is cleared


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    # deleter is C's free(): the struct and its shape are one malloc'd block (see the module docstring)
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_libc = ctypes.CDLL(None)
_malloc = _libc.malloc
_malloc.restype = ctypes.c_void_p
_malloc.argtypes = [ctypes.c_size_t]
_FREE = ctypes.cast(_libc.free, ctypes.c_void_p).value


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _Export:
    """A DLPack producer for ``tvm.runtime.from_dlpack``: int32 ``shape`` at ``base + byte_offset``."""

    def __init__(self, base, byte_offset: int, shape: tuple):
        self.base, self.byte_offset, self.shape = base, byte_offset, shape

    def __dlpack_device__(self):
        dev = self.base.device
        return dev.dlpack_device_type(), dev.index

    def __dlpack__(self, stream=None, **_):
        dev_type, dev_id = self.__dlpack_device__()
        ndim = len(self.shape)
        head = ctypes.sizeof(_DLManagedTensor)
        addr = _malloc(head + 8 * ndim)
        if not addr:
            raise MemoryError("malloc of a DLPack struct failed")
        ctypes.memset(addr, 0, head)
        shape = (ctypes.c_int64 * ndim).from_address(addr + head)
        shape[:] = list(self.shape)
        m = _DLManagedTensor.from_address(addr)
        m.dl_tensor.data = self.base.data_ptr() + self.byte_offset
        m.dl_tensor.device = _DLDevice(dev_type, dev_id)
        m.dl_tensor.ndim = ndim
        m.dl_tensor.dtype = _DLDataType(0, 32, 1)  # int32
        m.dl_tensor.shape = ctypes.cast(addr + head, ctypes.POINTER(ctypes.c_int64))
        m.dl_tensor.byte_offset = 0
        m.deleter = _FREE  # TVM's tensor owns the block from here on
        return _capsule_new(addr, b"dltensor", None)


class IndexBuffers:
    """A packed host int32 buffer and a ring of :data:`RING` device buffers of the same capacity.

    Use: ``slot = ib.next_slot(need)`` (grows the buffers when ``need`` elements do not fit),
    fill ``ib.host[:used]``, ``ib.upload(slot, used)``, then ``ib.view(slot, offset, shape)``.
    """

    def __init__(self, device, capacity: int):
        import tvm_ffi

        self.device = device
        self._copy = tvm_ffi.get_global_func("runtime.TVMTensorCopyFromTo")
        self._retired: list = []  # earlier allocations (views handed out may still point there)
        self._turn = 0
        self.generation = 0  # bumped whenever the view cache is dropped (see next_slot)
        self.host_tensor: Any = None  # the host buffer (tvm, CPU); ``host`` is a NumPy view of it
        self.host: np.ndarray = np.zeros(0, np.int32)
        self.host_bytes = self.host.data.cast("B")  # the same memory as bytes (write_concatenated)
        self._dev: list = []
        self._allocate(capacity)

    @property
    def capacity(self) -> int:
        return self.host.shape[0]

    def _allocate(self, capacity: int) -> None:
        import tvm

        capacity = -(-max(capacity, _BUCKET) // _BUCKET) * _BUCKET
        if self.host_tensor is not None:
            self._retired.append((self.host_tensor, self._dev))
        self.host_tensor = tvm.runtime.empty((capacity,), "int32", tvm.cpu(0))
        self.host = np.from_dlpack(self.host_tensor)  # writes land in host_tensor's memory
        self.host[:] = 0
        self.host_bytes = self.host.data.cast("B")
        self._dev = [tvm.runtime.empty((capacity,), "int32", self.device) for _ in range(RING)]
        self._views: list = [{} for _ in range(RING)]
        self._copies: list = [{} for _ in range(RING)]

    def next_slot(self, need: int) -> int:
        """The device slot for the next forward; grows every buffer first when ``need`` > capacity."""
        if need > self.capacity:
            self._allocate(max(need, 2 * self.capacity))
            self.generation += 1
        self._turn = slot = (self._turn + 1) % RING
        if len(self._views[slot]) >= _MAX_VIEWS:  # many distinct shapes: start over (views stay valid)
            self._views[slot] = {}
            self.generation += 1
        return slot

    def write_concatenated(self, offset: int, count: int, parts) -> None:
        """``host[offset : offset + count]`` = the concatenation of the int32 arrays ``parts`` (C
        contiguous, ``count`` elements in all; ValueError otherwise). ``b"".join`` reads each part
        through the buffer protocol: half the per-part cost of ``np.concatenate``."""
        self.host_bytes[4 * offset : 4 * (offset + count)] = b"".join(parts)

    def upload(self, slot: int, used: int) -> None:
        """Copy ``host[:used]`` (rounded up to a bucket) to device slot ``slot``: one copy."""
        n = min(-(-max(used, 1) // _BUCKET) * _BUCKET, self.capacity)
        pair = self._copies[slot].get(n)
        if pair is None:
            pair = (self.host_tensor._create_view((n,)), self._dev[slot]._create_view((n,)))
            self._copies[slot][n] = pair
        self._copy(*pair)

    def view(self, slot: int, offset: int, shape: tuple):
        """A device tensor of int32 ``shape`` at element ``offset`` of slot ``slot`` (cached)."""
        key = (offset, shape)
        views = self._views[slot]
        t = views.get(key)
        if t is None:
            import tvm

            assert offset % ALIGN == 0, "views start on 64-byte boundaries"
            export = _Export(self._dev[slot], 4 * offset, shape)
            t = views[key] = tvm.runtime.from_dlpack(export)
        return t

    def tail(self, slot: int, offset: int):
        """The 1-D view from ``offset`` to the end of the slot (for the last, variable-length array)."""
        return self.view(slot, offset, (self.capacity - offset,))
