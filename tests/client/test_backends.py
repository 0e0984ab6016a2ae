"""Backend pieces that need no GPU: copy planning, the CUDA driver wrapper, device dispatch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import hisparse
from hisparse.client import backends
from hisparse.client.backends import cuda


def test_runs_merge_consecutive_pages_and_rows():
    ids = np.array([4, 5, 6, 9, 10, 2])
    rows = np.array([0, 1, 2, 3, 4, 5])
    assert backends.runs(ids, rows) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    # consecutive pages from rows that are not consecutive are separate copies
    assert backends.runs(np.array([1, 2, 3]), np.array([0, 2, 3])) == [(0, 1, 1), (2, 2, 2)]
    assert backends.runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


def test_copy_itemsize_needs_every_address_aligned():
    assert backends.copy_itemsize(41984, 4096, 8 * 3) == 8
    assert backends.copy_itemsize(41984, 4096, 4) == 4
    assert backends.copy_itemsize(41984, 4096, 1) == 1
    assert backends.copy_itemsize(6, 4096, 4096) == 2  # rows of 6 bytes: 2-byte elements


def test_page_ids_outside_the_region_are_refused():
    with pytest.raises(hisparse.InvalidArgument):
        backends.check_page_ids(np.array([0, 8]), 8)
    with pytest.raises(hisparse.InvalidArgument):
        backends.check_page_ids(np.array([-1]), 8)


def test_register_chunks_cover_the_region_in_64gib_pieces():
    gib = 1 << 30
    base = 0x7F0000000000
    chunks = cuda.register_chunks(base, 150 * gib)
    assert chunks == [(base, 64 * gib), (base + 64 * gib, 64 * gib), (base + 128 * gib, 22 * gib)]
    assert cuda.register_chunks(base, 64 * gib) == [(base, 64 * gib)]
    odd = cuda.register_chunks(base, 3274752 * 7, max_chunk_bytes=3274752 * 3)
    assert [n for _, n in odd] == [3274752 * 3, 3274752 * 3, 3274752]
    assert sum(n for _, n in odd) == 3274752 * 7 and all(a == base + 3274752 * 3 * i for i, (a, _) in enumerate(odd))
    with pytest.raises(ValueError):
        cuda.register_chunks(base, 0)


def test_check_turns_driver_statuses_into_typed_errors():
    from cuda.bindings import driver as cu

    assert cuda.check((cu.CUresult.CUDA_SUCCESS,)) is None
    assert cuda.check((cu.CUresult.CUDA_SUCCESS, 7)) == 7
    assert cuda.check((cu.CUresult.CUDA_SUCCESS, 1, 2)) == (1, 2)
    with pytest.raises(cuda.CudaError) as info:
        cuda.check((cu.CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,), "cuMemHostRegister")
    err = info.value
    assert isinstance(err, hisparse.HisparseError)
    assert err.status == 712 and err.name == "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
    assert "cuMemHostRegister failed" in str(err)


def test_no_driver_is_a_clean_error():
    try:
        from cuda.bindings import driver as cu

        cu.cuInit(0)
        pytest.skip("a CUDA driver is present here")
    except Exception:
        pass
    with pytest.raises(cuda.CudaError, match="no CUDA driver"):
        cuda.init_driver(0)


def test_client_imports_without_torch_or_a_gpu():
    code = ("import sys; import hisparse.client, hisparse.client.backends.cuda, hisparse.client.backends.cpu; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_tensors_on_other_devices_have_no_backend():
    import torch

    assert backends.for_tensor(torch.zeros(1)).name == "cpu"
    assert backends.for_tensor(np.zeros(1)).name == "cpu"
    with pytest.raises(hisparse.InvalidArgument):
        backends.for_tensor(torch.zeros(1, device="meta"))
