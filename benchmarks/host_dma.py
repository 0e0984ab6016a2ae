"""host_dma: how fast the GPU's copy engines move bytes to and from each kind of host memory.

The client's CUDA copies run on the copy engines between the GPU and the
region, a registered ``MAP_SHARED`` file mapping. This measures, in one run,
host-to-device and device-to-host bandwidth for the same bytes in:

- ``pinned``: torch's pinned allocation (``cudaHostAlloc``), the baseline;
- ``anon-4k`` / ``anon-thp``: an anonymous mapping without / with transparent
  huge pages, registered (``cuMemHostRegister``);
- ``shm``: a file in ``--shm-dir`` (tmpfs), registered, as the daemon's region is;
- ``shm-thp``: the same with ``MADV_HUGEPAGE`` (huge only where the kernel's
  ``shmem_enabled`` allows it);
- ``hugetlbfs``: a file in ``--hugetlbfs DIR`` when given (a region there is
  what ``--shm-dir DIR`` on hugetlbfs gives the daemon);

each as one contiguous copy (``1d``) and as the client's per-page 2D copies
(``pages``, ``dma.plan`` over a GLM-5-like layout). Ratios are against
``pinned 1d`` of the same run.

    python benchmarks/host_dma.py [--size 256MiB] [--reps 10] [--hugetlbfs /mnt/huge]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hisparse import KVLayout, format_size, parse_size  # noqa: E402
from hisparse.client.backends import cuda, dma  # noqa: E402
from hisparse.shm.region import file_size_for  # noqa: E402

import numpy as np  # noqa: E402

MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15


def address(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def madvise(mm: mmap.mmap, advice: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(address(mm)), ctypes.c_size_t(len(mm)), advice) != 0:
        print(f"  madvise({advice}) failed: {os.strerror(ctypes.get_errno())}")


def file_mapping(directory: str, size: int) -> mmap.mmap:
    fd, path = tempfile.mkstemp(dir=directory, prefix="host_dma.")
    try:
        os.unlink(path)
        size = file_size_for(directory, size)  # whole huge pages on hugetlbfs
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def kinds(size: int, shm_dir: str, hugetlbfs: str | None):
    import torch

    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1)
    yield "pinned", pinned.data_ptr(), None
    for name, make, advice in (("anon-4k", lambda: mmap.mmap(-1, size), MADV_NOHUGEPAGE),
                               ("anon-thp", lambda: mmap.mmap(-1, size), MADV_HUGEPAGE),
                               ("shm", lambda: file_mapping(shm_dir, size), None),
                               ("shm-thp", lambda: file_mapping(shm_dir, size), MADV_HUGEPAGE),
                               ("hugetlbfs", lambda: file_mapping(hugetlbfs, size), None)):
        if name == "hugetlbfs" and not hugetlbfs:
            continue
        try:
            mm = make()
        except OSError as exc:
            print(f"{name}: cannot map: {exc}")
            continue
        if advice is not None:
            madvise(mm, advice)
        np.frombuffer(mm, dtype=np.uint8)[::4096] = 1  # fault every page in before pinning
        cu = cuda.driver()
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        cuda.check(cu.cuMemHostRegister(address(mm), len(mm), flags), f"cuMemHostRegister ({name})")
        try:
            yield name, address(mm), mm
        finally:
            cuda.check(cu.cuMemHostUnregister(address(mm)), "cuMemHostUnregister")
            mm.close()


def measure(host: int, device: int, nbytes: int, plan: dma.Plan | None, reps: int) -> tuple[float, float]:
    import torch

    cu = cuda.driver()
    stream = torch.cuda.Stream()
    out = []
    for to_host in (False, True):
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if plan is not None:
                cuda.issue_2d(plan, host, device, to_host, stream.cuda_stream)
            elif to_host:
                cuda.check(cu.cuMemcpyDtoHAsync(host, device, nbytes, cu.CUstream(stream.cuda_stream)))
            else:
                cuda.check(cu.cuMemcpyHtoDAsync(device, host, nbytes, cu.CUstream(stream.cuda_stream)))
            stream.synchronize()
            times.append(time.perf_counter() - t0)
        out.append(nbytes / statistics.median(times[1:]) / 1e9)
    return out[0], out[1]


def sysfs(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"({exc.strerror})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256MiB")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--hugetlbfs", default=None, help="a hugetlbfs mount to map a file from")
    p.add_argument("--layout", default="78,64,656", help="layers,block_tokens,row_bytes of the pages")
    args = p.parse_args(argv)
    import torch

    layout = KVLayout(*(int(x) for x in args.layout.split(",")))
    n = max(1, parse_size(args.size) // layout.page_bytes)
    nbytes = n * layout.page_bytes
    torch.cuda.init()
    cuda.init_driver(torch.cuda.current_device())
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(2)
    # the region's layout with n pages: one 2D copy per page, as the client issues them
    plan = dma.plan(layout.num_layers, n, layout.layer_page_bytes, np.arange(n)[::-1].copy(),
                    np.arange(n), max_pitch=1 << 62)
    thp = "/sys/kernel/mm/transparent_hugepage/"
    print(f"host_dma: {format_size(nbytes)} ({n} pages of {layout.page_bytes:,} B), {args.reps} reps; "
          f"THP {sysfs(thp + 'enabled')}, shmem {sysfs(thp + 'shmem_enabled')}, "
          f"nr_hugepages {sysfs('/proc/sys/vm/nr_hugepages')}")
    base = None
    for name, host, _ in kinds(nbytes, args.shm_dir, args.hugetlbfs):
        for pattern, pl in (("1d", None), ("pages", plan)):
            h2d, d2h = measure(host, device.data_ptr(), nbytes, pl, args.reps)
            base = base or (h2d, d2h)
            print(f"{name:<10} {pattern:<6} H2D {h2d:6.2f} GB/s ({h2d / base[0]:.2f})   "
                  f"D2H {d2h:6.2f} GB/s ({d2h / base[1]:.2f})", flush=True)
        with open("/proc/meminfo") as f:  # whether this kind got huge pages
            print("           " + " ".join(f"{line.split()[0]}{line.split()[1]}" for line in f
                                           if line.startswith(("AnonHuge", "ShmemHuge", "HugePages_Free"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
