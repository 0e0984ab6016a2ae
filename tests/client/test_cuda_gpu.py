"""The CUDA backend on a real GPU and a real hisparsed (run by scripts/gpu-check)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import hisparse
from hisparse import client
from hisparse.client import pipeline
from hisparse.client.backends import cuda as cuda_backend
from hisparse.client.backends import cudadriver
from tests.client.engine import chain, finish, page_for, spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYOUT = hisparse.KVLayout(num_layers=8, block_tokens=64, row_bytes=656)  # 328 KiB pages


@pytest.fixture
def c(hisparsed):
    with client.attach("gpu/ns", LAYOUT, socket=hisparsed.socket, capacity="64MiB") as cl:
        yield cl


@pytest.fixture(params=["engines", "engines-by-layer", "engines-in-pieces", "kernel"])
def copy_path(request, c, monkeypatch):
    """Each copy path of the backend: one 2D copy per page, per layer of a run (cut where a
    registration piece ends, as in a region over 64 GiB), the kernel."""
    backend = cuda_backend.backend_for(torch.cuda.current_device())
    plans = []
    real = cuda_backend.dma.plan

    # The paths through runs are tested at any size: the backend would leave copies under
    # dma.MIN_COPY_BYTES (a run of 5 of these pages) to the kernel.
    min_copy = {"min_copy_bytes": 0} if request.param in ("engines-by-layer", "engines-in-pieces") else {}

    def recording(*args):
        plans.append(real(*args, **min_copy))
        return plans[-1]

    monkeypatch.setattr(cuda_backend.dma, "plan", recording)
    if request.param == "kernel":
        monkeypatch.setattr(backend, "copy_engines", False)
    elif request.param == "engines-by-layer":  # the region's layer slab over the device's pitch
        slab = c._session.region.geometry.num_pages * LAYOUT.layer_page_bytes
        monkeypatch.setattr(backend, "max_pitch", slab - 1)
    elif request.param == "engines-in-pieces":  # registered as if in pieces: a cut every 5 rows
        real_register = cuda_backend.register

        def in_pieces(region, *args, **kwargs):
            reg = real_register(region, *args, **kwargs)
            step = 5 * LAYOUT.layer_page_bytes
            return dataclasses.replace(reg, chunks=tuple(
                (reg.address + off, min(step, reg.size_bytes - off)) for off in range(0, reg.size_bytes, step)))

        monkeypatch.setattr(cuda_backend, "register", in_pieces)
    yield request.param
    if request.param == "kernel":
        assert not plans
    else:
        assert any(p is not None for p in plans)
        if request.param == "engines":
            assert all(p is not None and p.region_pitch == p.width * c._session.region.geometry.num_pages
                       for p in plans)


@pytest.fixture(params=["whole", "in-pieces"])
def calls(request, monkeypatch):
    """Calls whole, and in pieces of 4 pages (``hisparse.client.pipeline``): each piece's
    copies queued on the copy stream behind the previous piece's, committed once landed."""
    piece_bytes = 4 * LAYOUT.page_bytes if request.param == "in-pieces" else 1 << 40
    monkeypatch.setattr(pipeline, "PIECE_BYTES", piece_bytes)
    counts = []
    real = pipeline.pieces

    def recording(n: int, page_bytes: int) -> list[tuple[int, int]]:
        counts.append(len(real(n, page_bytes)))
        return real(n, page_bytes)

    monkeypatch.setattr(pipeline, "pieces", recording)
    yield request.param
    assert counts, "no call asked how to split itself: the CUDA backend must overlap"
    if request.param == "in-pieces":
        assert max(counts) > 1, counts
    else:
        assert max(counts) == 1, counts


def gpu_pages(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n, LAYOUT.page_bytes), dtype=torch.uint8, device="cuda", generator=g)


def test_cuda_store_load_round_trip_is_byte_exact(c, copy_path, calls):
    keys = chain("gpu", 40)
    pages = gpu_pages(40)
    assert c.store(keys, pages) == 40
    out = torch.zeros_like(pages)
    assert c.load(keys, out) == 40
    torch.cuda.synchronize()
    assert torch.equal(out, pages)
    # the bytes are in the region itself, in its layer-major layout
    host = torch.zeros((40, LAYOUT.page_bytes), dtype=torch.uint8)
    assert c.load(keys, host) == 40
    assert torch.equal(host, pages.cpu())


def test_cuda_scattered_ids_and_skipped_rows(c, copy_path, calls):
    keys = chain("scatter", 30)
    pages = gpu_pages(30, seed=1)
    assert c.store(keys[::3], pages[::3]) == 10  # strided source: made contiguous
    assert c.store(keys, pages) == 20  # rows 1, 2, 4, 5, ...: one gather of the rows to write
    order = [29, 0, 14, 3, 7, 22, 1]
    out = torch.zeros((len(order), LAYOUT.page_bytes), dtype=torch.uint8, device="cuda")
    assert c.load([keys[i] for i in order], out) == len(order)
    assert torch.equal(out, pages[order])


def test_cuda_unaligned_tensors(c, copy_path):
    keys = chain("odd", 5)
    pages = gpu_pages(5, seed=2)
    backing = torch.zeros(5 * LAYOUT.page_bytes + 1, dtype=torch.uint8, device="cuda")
    odd = backing[1:].view(5, LAYOUT.page_bytes)
    odd.copy_(pages)
    assert c.store(keys, odd) == 5
    out_backing = torch.zeros_like(backing)
    out = out_backing[1:].view(5, LAYOUT.page_bytes)
    assert c.load(keys, out) == 5
    assert torch.equal(out, pages)


def test_cuda_layer_rows_is_the_uva_view_of_the_slab(c):
    keys = chain("rows", 4)
    pages = gpu_pages(4, seed=3)
    c.store(keys, pages)
    for layer in (0, LAYOUT.num_layers - 1):
        dev = c.layer_rows(layer, device="cuda")
        assert dev.is_cuda and dev.shape == (c.num_pages * LAYOUT.block_tokens, LAYOUT.row_bytes)
        assert torch.equal(dev.cpu(), c.layer_rows(layer))


def test_region_is_registered_once_per_process(hisparsed):
    a = client.attach("gpu/once", LAYOUT, socket=hisparsed.socket, capacity="16MiB")
    b = client.attach("gpu/once", LAYOUT, socket=hisparsed.socket)
    keys = chain("once", 3)
    a.store(keys, gpu_pages(3))
    b.load(keys, torch.empty((3, LAYOUT.page_bytes), dtype=torch.uint8, device="cuda"))
    region = a._session.region
    registrations = [r for r, owner in cudadriver._REGISTRY.values() if owner is region]
    assert len(registrations) == 1
    assert registrations[0].size_bytes == region.geometry.size_bytes
    a.close()
    b.close()
    assert cuda_backend.is_registered(region)  # kept mapped: registrations live with the process


def test_cpu_engine_stores_gpu_engine_loads(hisparsed):
    # another process (numpy, no GPU) stores; this one loads straight to the GPU
    finish(spawn(hisparsed.socket, "store", "gpu/shared", LAYOUT, seed="cpu", count=12, capacity="16MiB"))
    keys = chain("cpu", 12)
    with client.attach("gpu/shared", LAYOUT, socket=hisparsed.socket) as cl:
        out = torch.zeros((12, LAYOUT.page_bytes), dtype=torch.uint8, device="cuda")
        assert cl.load(keys, out) == 12
        host = out.cpu().numpy()
        assert all(np.array_equal(host[i], page_for(k, LAYOUT.page_bytes)) for i, k in enumerate(keys))


def test_a_failed_registration_raises():
    # an address range that is not mapped cannot be pinned: an error, never a fall-back
    cuda_backend.init_driver(torch.cuda.current_device())
    cu = cuda_backend.driver()
    with pytest.raises(cuda_backend.CudaError):
        cuda_backend.check(cu.cuMemHostRegister(4096, 4096, cu.CU_MEMHOSTREGISTER_DEVICEMAP),
                           "cuMemHostRegister")


def test_two_threads_store_and_load_on_one_backend_at_once(c, calls):
    # one backend, one copy stream: each thread's bytes land whole, whatever the other does
    import threading

    results: dict[int, bool] = {}

    def work(i: int) -> None:
        keys = chain(f"thread{i}", 12)
        pages = gpu_pages(12, seed=10 + i)
        out = torch.zeros_like(pages)
        for _ in range(5):
            c.store(keys, pages)
            assert c.load(keys, out) == 12
            torch.cuda.synchronize()
        results[i] = torch.equal(out, pages)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: True, 1: True}


def test_copies_wait_for_the_callers_stream(c, calls):
    # The pages are written on the caller's current stream, behind a slow kernel: a store
    # that did not wait for that stream would copy the zeros that were there before.
    keys = chain("order", 40)
    want = gpu_pages(40, seed=5)
    pages = torch.zeros_like(want)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of the GPU's clock
        pages.copy_(want)
        assert c.store(keys, pages) == 40
        out = torch.empty_like(want)
        torch.cuda._sleep(200_000_000)
        out.zero_()  # behind the sleep: a load that did not wait would land first, then be zeroed
        assert c.load(keys, out) == 40
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_a_copy_that_fails_while_queuing_gives_everything_back(c, calls, monkeypatch):
    # The driver refuses the 13th 2D copy: 12 are queued by then (in pieces, some of an
    # earlier piece landed and may have been committed). The store raises, waits for the
    # copies it queued, and gives back every reservation; the keys then store and load whole.
    keys = chain("refused", 40)
    pages = gpu_pages(40, seed=7)
    cu = cuda_backend.driver()
    real, issued = cu.cuMemcpy2DAsync, []

    def refusing(copy, stream):
        issued.append(1)
        if len(issued) == 13:
            return (cu.CUresult.CUDA_ERROR_INVALID_VALUE,)
        return real(copy, stream)

    monkeypatch.setattr(cu, "cuMemcpy2DAsync", refusing)
    with pytest.raises(cuda_backend.CudaError):
        c.store(keys, pages)
    monkeypatch.setattr(cu, "cuMemcpy2DAsync", real)
    stats = c.stats()["namespaces"]["gpu/ns"]
    assert stats["writing_pages"] == 0 and stats["pinned_pages"] == 0, stats
    c.store(keys, pages)  # what the failed store had committed stays (its copies landed)
    assert c.lookup(keys) == 40
    out = torch.zeros_like(pages)
    assert c.load(keys, out) == 40
    torch.cuda.synchronize()
    assert torch.equal(out, pages)

