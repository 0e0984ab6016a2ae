"""vLLM 0.34's offloading types and pointer helpers, for the releases that lack them.

Copied from vLLM 0.34.0 (``vllm/v1/kv_offload/base.py`` and
``pointer_utils.py``, Apache-2.0, the vLLM project), so the adapter's
worker and spec run one code path on every supported release: on 0.32 and
0.33 the worker resolves the block-id ``GPULoadStoreSpec`` it is given into
``DevicePointers`` itself (``resolve_device_pointers``), as 0.34's connector
does before calling it. ``hisparse.vllm.compat`` picks vLLM's own names where
the release has them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

# The labels of one info metric series: a label name mapped to its value.
ConfigInfoMapping = Mapping[str, "str | int | float | bool"]


@dataclass(frozen=True)
class ConfigInfo:
    """Static facts published on vllm:kv_offload_config_info (0.33+); unused before."""

    @classmethod
    def config_info_keys(cls) -> tuple[str, ...]:
        return tuple(info.name for info in fields(cls))

    def as_config_info(self) -> ConfigInfoMapping:
        values = (getattr(self, info.name) for info in fields(self))
        return {key: "None" if value is None else value for key, value in zip(self.config_info_keys(), values)}


@dataclass
class DevicePointers:
    """Flat arrays in canonical order: for each group, each data ref, each block: ptrs[i], sizes[i]."""

    ptrs: np.ndarray  # uint64 device addresses
    sizes: np.ndarray  # uint64 bytes per copy
    group_block_counts: tuple[int, ...]  # device blocks per group
    group_data_ref_counts: tuple[int, ...]  # data refs per group
    block_indices: tuple[int, ...]  # logical block offset per group


class DevicePointerGroupInfo(NamedTuple):
    group_idx: int
    group_size: int
    n_data_refs: int
    skip: int
    n_chunks: int
    dev_ptr_offset: int


def iter_pointer_groups(device_ptrs: Any, blocks_per_chunk: int) -> Iterator[DevicePointerGroupInfo]:
    """Non-empty groups with their chunk count and the blocks to skip in the first chunk."""
    dev_ptr_offset = 0
    for group_idx, (group_size, n_data_refs, block_idx) in enumerate(
            zip(device_ptrs.group_block_counts, device_ptrs.group_data_ref_counts, device_ptrs.block_indices)):
        if group_size == 0:
            continue
        skip = block_idx % blocks_per_chunk
        n_chunks = -(-(group_size + skip) // blocks_per_chunk)
        yield DevicePointerGroupInfo(group_idx=group_idx, group_size=group_size, n_data_refs=n_data_refs,
                                     skip=skip, n_chunks=n_chunks, dev_ptr_offset=dev_ptr_offset)
        dev_ptr_offset += group_size * n_data_refs


def resolve_device_pointers(device_spec: Any, kv_caches: Any) -> DevicePointers:
    """A ``GPULoadStoreSpec``'s block ids as device addresses: ``base + block_id * row_stride`` per ref."""
    block_ids = np.asarray(device_spec.block_ids)
    group_sizes = list(device_spec.group_sizes)
    block_indices = list(device_spec.block_indices)
    group_data_refs = kv_caches.group_data_refs
    assert len(group_sizes) == len(group_data_refs) == len(block_indices)
    num_ops = sum(gs * len(refs) for gs, refs in zip(group_sizes, group_data_refs))
    ptrs = np.empty(num_ops, dtype=np.uint64)
    sizes = np.empty(num_ops, dtype=np.uint64)
    blk_offset = op_idx = 0
    for group_size, data_refs in zip(group_sizes, group_data_refs):
        if group_size == 0:
            continue
        ids = block_ids[blk_offset:blk_offset + group_size].astype(np.uint64)
        for ref in data_refs:
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            end = op_idx + group_size
            ptrs[op_idx:end] = np.uint64(tensor.data_ptr()) + ids * np.uint64(tensor.stride(0))
            sizes[op_idx:end] = ref.page_size_bytes
            op_idx = end
        blk_offset += group_size
    assert blk_offset == len(block_ids) and op_idx == num_ops
    return DevicePointers(ptrs=ptrs, sizes=sizes, group_block_counts=tuple(group_sizes),
                          group_data_ref_counts=tuple(len(refs) for refs in group_data_refs),
                          block_indices=tuple(block_indices))
