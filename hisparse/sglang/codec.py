"""Page bytes between an SGLang host pool's slots and hisparse's page layout.

``read(host_index)`` gives one page as uint8 ``[page_bytes]`` in the
namespace's layout; ``write(host_index, page)`` puts a page (uint8
``[num_layers, page_size*row_bytes]``, e.g. a ``Pin.view`` straight from the
region) into the host slots, in one copy. MLA KV pools are addressed
through their ``kv_buffer`` per layout (see ``namespace``) and copied with
numpy (torch's CPU copy of these strided views runs on its intra-op thread
pool, which on a busy host is two orders of magnitude slower than one
memcpy per layer); every other pool through SGLang's own ``get_data_page`` /
``set_from_flat_data_page``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hisparse.sglang.namespace import PoolGeometry


class PageCodec:
    def __init__(self, host_pool: Any, geometry: PoolGeometry) -> None:
        self.pool = host_pool
        self.geometry = geometry
        self._flat_dtype = host_pool.get_data_page(0, flat=True).dtype

    def _index(self, host_index: int) -> int:
        convert = getattr(self.pool, "_storage_page_index", None)
        return int(convert(host_index)) if convert is not None else int(host_index)

    def _mla_rows(self, host_index: int) -> torch.Tensor:
        """The page's slots as uint8 ``[layers, page_size, 1, row_bytes]`` (a view)."""
        buf = self.pool.kv_buffer
        i = self._index(host_index)
        ps = self.geometry.page_size
        layout = self.pool.layout
        if layout == "layer_first":
            rows = buf[:, i:i + ps]
        elif layout == "page_first":
            rows = buf[i:i + ps].transpose(0, 1)
        elif layout == "page_first_direct":
            rows = buf[i // ps]
        else:  # pragma: no cover - namespace.is_mla_kv_pool admits only the three above
            raise AssertionError(layout)
        return rows.view(torch.uint8)

    def read(self, host_index: int) -> torch.Tensor:
        if self.geometry.canonical:
            return self._mla_rows(host_index).reshape(-1)
        return self.pool.get_data_page(int(host_index), flat=True).contiguous().view(torch.uint8).reshape(-1)

    def read_into(self, host_index: int, out: torch.Tensor) -> None:
        """``out``: uint8 ``[page_bytes]``, on the CPU."""
        if self.geometry.canonical:
            g = self.geometry
            np.copyto(out.numpy().reshape(g.num_layers, g.page_size, 1, g.row_bytes),
                      self._mla_rows(host_index).numpy())
        else:
            out.copy_(self.read(host_index))

    def write(self, host_index: int, page: torch.Tensor) -> None:
        g = self.geometry
        if g.canonical:
            np.copyto(self._mla_rows(host_index).numpy(),
                      page.numpy().reshape(g.num_layers, g.page_size, 1, g.row_bytes))
        else:
            flat = page.reshape(-1).contiguous().view(self._flat_dtype)
            self.pool.set_from_flat_data_page(int(host_index), flat)
