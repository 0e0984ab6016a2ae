"""The three CPU stand-ins SGLang 0.5.23's cache stack needs on a machine without a GPU.

1. Imports: ``sglang.srt.configs`` imports torchvision (absent here; a wheel
   would have to match torch exactly), so ``torchvision.*`` resolves to
   SGLang's own import mock (``sglang._platform_stubs._MockModule``).
2. Host pinning: host pools call ``_cuda_host_register`` on their buffers;
   without CUDA that is a no-op.
3. The GPU<->host copy kernels (``sgl_kernel.kvcacheio``) of the MLA and DSA
   indexer host pools become torch indexing over the same buffers.

Nothing else in SGLang is replaced: the radix cache, the HiCache controller
with its threads, the host pools, the storage factory and the linker
plumbing run as shipped. ``install()`` is idempotent.
"""

from __future__ import annotations

import sys

_installed = False


class _TorchvisionFinder:
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname != "torchvision" and not fullname.startswith("torchvision."):
            return None
        from sglang._platform_stubs import _MockModule

        module = sys.modules.get(fullname)
        if module is None:
            module = sys.modules[fullname] = _MockModule(fullname)
            parent, _, child = fullname.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)
        return module.__spec__


def install_imports() -> None:
    if any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        return
    # transformers asks find_spec whether torchvision exists: tell it no, before
    # anything binds the answer, so that its image code never reaches the mock.
    import transformers.utils as tf_utils
    import transformers.utils.import_utils as tf_import_utils

    for name in ("is_torchvision_available", "is_torchvision_v2_available"):
        for module in (tf_import_utils, tf_utils):
            if hasattr(module, name):
                setattr(module, name, lambda: False)
    sys.meta_path.insert(0, _TorchvisionFinder())


def _host_rows(pool, host_layer: int, host_indices):  # noqa: ANN001, ANN202
    """(buffer, index) addressing one host layer's rows of ``host_indices`` in ``pool.kv_buffer``."""
    buf = pool.kv_buffer
    if pool.layout == "layer_first":
        return buf[host_layer], host_indices
    if pool.layout == "page_first":
        return buf[:, host_layer], host_indices
    if pool.layout == "page_first_direct":
        ps = pool.page_size
        return buf[:, host_layer], (host_indices // ps, host_indices % ps)
    raise NotImplementedError(f"CPU stand-in copies: layout {pool.layout}")


def _mla_backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):  # noqa: ANN001
    host_indices = host_indices.cpu().long()
    device_indices = device_indices.cpu().long()
    for layer_id, host_layer in self._host_layer_by_controller.items():
        device = self.device_kv_buffers[self._buffer_index_by_layer[layer_id]]
        rows, index = _host_rows(self, host_layer, host_indices)
        rows[index] = device[device_indices].to(rows.dtype)


def _mla_load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id,  # noqa: ANN001
                                  io_backend, *, is_draft=False):  # noqa: ANN001
    host_layer = self._host_layer_by_controller.get(layer_id)
    if host_layer is None:
        return
    device = self.device_kv_buffers[self._buffer_index_by_layer[layer_id]]
    rows, index = _host_rows(self, host_layer, host_indices.cpu().long())
    device[device_indices.cpu().long()] = rows[index]


def install() -> None:
    """All three stand-ins; call before building any SGLang cache."""
    global _installed
    if _installed:
        return
    install_imports()
    from sglang.srt.mem_cache.pool_host import base, common, mla

    common._cuda_host_register = lambda *args, **kwargs: None
    if hasattr(base, "_cuda_host_register"):
        base._cuda_host_register = common._cuda_host_register
    mla.MLATokenToKVPoolHost.backup_from_device_all_layer = _mla_backup_from_device_all_layer
    mla.MLATokenToKVPoolHost.load_to_device_per_layer = _mla_load_to_device_per_layer
    _installed = True
