"""The CUDA driver (cuda-python) and the region as the GPU sees it.

Every driver call goes through ``check``: a failure raises ``CudaError``
naming the call. ``cuInit`` runs once a process (again in a forked child),
and a thread without a current context gets the device's primary context
(torch's).

The mapped region is registered with the driver once per process
(``cuMemHostRegister``, portable and device-mapped) in chunks of at most
``MAX_REGISTER_CHUNK_BYTES``: one call over ~64 GiB can fail, and pinning
costs 0.25-0.5 s per GiB, so it is done once and kept for the life of the
process, with the mapping (it is never unmapped under a registration or a
device view). A failed registration raises ``CudaError``; there is no
pageable fall-back, because an unregistered region would make every copy
silently half as fast. ``device_view`` is a torch CUDA tensor over the
registered region's device address (UVA), built without a copy.

Importing this module needs neither a GPU nor cuda-python; using it without
a driver raises ``CudaError``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hisparse.errors import HisparseError
from hisparse.layout import format_size

if TYPE_CHECKING:
    import torch

    from hisparse.shm.region import RegionMap

log = logging.getLogger(__name__)

MAX_REGISTER_CHUNK_BYTES = 64 << 30


class CudaError(HisparseError):
    """A CUDA driver call failed, or no usable driver is present."""

    def __init__(self, message: str, status: int | None = None, name: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.name = name


def driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise CudaError(f"cuda-python is not installed ({exc}); pip install 'hisparse[engine]' "
                        "into this environment") from None
    return driver


def describe(status: Any) -> tuple[str, str]:
    """(name, description) of a CUresult; works without a loadable driver."""
    cu = driver()
    try:
        err, name = cu.cuGetErrorName(status)
        err2, text = cu.cuGetErrorString(status)
        if int(err) == 0 and int(err2) == 0:
            return name.decode(), text.decode()
    except Exception:  # the driver library itself may be missing
        pass
    try:
        return cu.CUresult(int(status)).name, "(no driver to describe it)"
    except ValueError:
        return f"CUresult {int(status)}", "(unknown status)"


def check(result: Any, what: str = "CUDA driver call") -> Any:
    """Raise ``CudaError`` unless a cuda-python result is CUDA_SUCCESS; return its values.

    cuda-python returns ``(status, *values)``; this returns ``None``, the one
    value, or a tuple of them.
    """
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    if int(status) != 0:
        name, text = describe(status)
        raise CudaError(f"{what} failed: {name}: {text}", int(status), name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def register_chunks(address: int, size_bytes: int,
                    max_chunk_bytes: int = MAX_REGISTER_CHUNK_BYTES) -> list[tuple[int, int]]:
    """``(address, size)`` of each registration call covering ``[address, address+size)``."""
    if size_bytes <= 0:
        raise ValueError(f"nothing to register: {size_bytes} bytes")
    if max_chunk_bytes <= 0:
        raise ValueError(f"chunk limit must be positive: {max_chunk_bytes}")
    return [(address + off, min(max_chunk_bytes, size_bytes - off))
            for off in range(0, size_bytes, max_chunk_bytes)]


_INITIALISED_PID = 0  # the process whose cuInit succeeded (a forked child must init again)


def init_driver(device_index: int) -> None:
    """``cuInit`` (once a process) and a current context on this thread (torch's primary context)."""
    global _INITIALISED_PID
    cu = driver()
    if _INITIALISED_PID != os.getpid():
        try:
            status = cu.cuInit(0)
        except HisparseError:
            raise
        except Exception as exc:  # cuda-python raises its own types when libcuda is absent
            raise CudaError(f"no CUDA driver: {exc}") from None
        check(status, "cuInit")
        _INITIALISED_PID = os.getpid()
    ctx = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        dev = check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        primary = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")


@dataclass(frozen=True)
class Registration:
    address: int
    size_bytes: int
    device_address: int
    chunks: tuple[tuple[int, int], ...]


# Host address -> registration. Kept for the life of the process, together
# with the RegionMap it belongs to, so the mapping can never be unmapped
# under a registration or a device view.
_REGISTRY: dict[int, tuple[Registration, RegionMap]] = {}
_REGISTRY_LOCK = threading.Lock()


def register(region: RegionMap, device_index: int = 0,
             ranges: Sequence[tuple[int, int]] | None = None) -> Registration:
    """Register the region's mapping once per process; returns its device address.

    ``ranges``: ``(start, end)`` byte offsets of each registration call, when
    the caller must choose the cuts (vLLM HiSparse: never inside a block);
    default ``register_chunks``. They must tile the region from 0.
    """
    address, size = region.address, region.geometry.size_bytes
    with _REGISTRY_LOCK:
        held = _REGISTRY.get(address)
        if held is not None:
            cuts = [(address + start, end - start) for start, end in ranges or ()]
            if ranges is not None and list(held[0].chunks) != cuts:  # its copies would span two
                raise CudaError(f"region {region.path} is registered already, in other pieces than "
                                f"the {len(cuts)} asked for: register it with its ranges first")
            return held[0]
        init_driver(device_index)
        cu = driver()
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        chunks = register_chunks(address, size)
        if ranges is not None:
            chunks = [(address + start, end - start) for start, end in ranges]
            if ranges[0][0] != 0 or ranges[-1][1] < size or any(
                    a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
                raise ValueError(f"registration ranges {ranges} do not tile the region of {size} B")
        started = time.monotonic()
        done: list[tuple[int, int]] = []
        try:
            for chunk_address, chunk_bytes in chunks:
                check(cu.cuMemHostRegister(chunk_address, chunk_bytes, flags),
                      f"cuMemHostRegister of {format_size(chunk_bytes)} at {chunk_address:#x}")
                done.append((chunk_address, chunk_bytes))
            device_addresses = [int(check(cu.cuMemHostGetDevicePointer(a, 0), "cuMemHostGetDevicePointer"))
                                for a, _ in chunks]
        except BaseException:
            _unregister_quietly([a for a, _ in done])
            raise
        base = device_addresses[0]
        for (chunk_address, _), dptr in zip(chunks, device_addresses):
            # One tensor spans the region, so its device range must be contiguous
            # too (it always is under UVA, where it equals the host range).
            if dptr - base != chunk_address - address:
                _unregister_quietly([a for a, _ in chunks])
                raise CudaError("the region's device mapping is not contiguous across chunks")
        reg = Registration(address, size, base, tuple(chunks))
        _REGISTRY[address] = (reg, region)
        log.info("registered region %s (%s) with CUDA in %d chunk(s) in %.2f s",
                 region.path, format_size(size), len(chunks), time.monotonic() - started)
        return reg


def _unregister_quietly(addresses: list[int]) -> None:
    """Undo a partial registration; the error that caused it is the one worth raising."""
    cu = driver()
    for chunk_address in addresses:
        try:
            check(cu.cuMemHostUnregister(chunk_address), "cuMemHostUnregister")
        except CudaError as exc:
            log.warning("%s", exc)


class _DeviceArray:
    """A device pointer wrapped for ``torch.as_tensor`` (CUDA Array Interface v3)."""

    def __init__(self, device_address: int, shape: tuple[int, ...], typestr: str, owner: Any) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (device_address, False), "version": 3,
                                         "strides": None}
        self._owner = owner  # keeps the mapping alive while torch holds the tensor


_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


def device_view(region: RegionMap, device_index: int, offset_bytes: int, shape: tuple[int, ...],
                itemsize: int = 1) -> torch.Tensor:
    """A CUDA tensor over ``shape`` elements of the registered region from ``offset_bytes``."""
    import torch

    reg = register(region, device_index)
    array = _DeviceArray(reg.device_address + offset_bytes, shape, _TYPESTR[itemsize], region)
    # No device= here: as_tensor would copy to another device instead of failing.
    tensor = torch.as_tensor(array)
    if tensor.device.index != device_index:
        raise CudaError(f"region is mapped for {tensor.device}, not cuda:{device_index}: "
                        "one GPU per process is supported")
    return tensor


def is_registered(region: RegionMap) -> bool:
    """True when this process registered the region (it then stays mapped)."""
    with _REGISTRY_LOCK:
        return any(owner is region for _, owner in _REGISTRY.values())
