"""The sparse session: requests that keep decoding when their KV outgrows HBM.

Per engine, a ``SparseSession`` owns nothing on the GPU: every row it uses
is a row of the engine's own KV cache tensors, in blocks that the engine's
allocator hands out and takes back. Per request it keeps

- the block table: ``resident_blocks[b]``, the engine block holding logical
  block ``b`` (``-1`` once spilled);
- the host page table: ``host_pages[b]``, the region page holding logical
  block ``b`` (``-1`` while resident), pinned for the request's life;
- ``H`` hot rows (whole engine blocks from the allocator) and, per layer,
  the position each holds and when it was last used.

``spill`` stores the blocks older than the active tail (one ``store``, then
a ``pin`` for the request's life) and hands their engine blocks back.
``resolve`` runs the fused kernel for one layer over the batch: resident
rows as they are, hot rows where the position is already hot, missing rows
pulled from the layer's host slab into least recently used hot rows.
``release`` gives everything back.

Fencing: every spilled page is pinned under the client's session, and the
pins hold that session's fence. Before each resolve the session checks the
fence (one memory read); when the session was lost (lease expiry while the
engine stalled, a daemon restart) it re-pins every request's spilled keys
on the new session and rewrites the host page table before any row is read
through it. A request whose keys cannot all be pinned again is failed
(``RequestsLost``, its host pages cleared so its rows resolve to ``-1``,
never to another request's bytes); the engine releases it.

The tables live in fixed-shape device tensors of ``max_reqs`` slots, live
requests compacted into slots ``0..n-1`` (the kernel treats the rest as
padding through ``num_real_reqs``). They change only when a request is
added, grows, spills or ends, so a decode step (``resolve`` with a device
``step`` and preallocated ``out``) reads and writes only persistent tensors
and can be captured in a CUDA graph.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import torch
except ImportError as _exc:
    from hisparse.extras import missing

    raise missing("torch", "hisparse.client.sparse (the sparse tier)") from _exc

from hisparse.client.client import Client, ClientSession
from hisparse.client.pins import Pin
from hisparse.errors import CapacityError, HisparseError, InvalidArgument, LeaseExpired
from hisparse.protocol import Op

Resolver = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class RequestsLost(LeaseExpired):
    """Requests whose spilled pages could not be held again after their session was lost.

    Their rows resolve to ``-1`` from now on; the engine should release them
    (``SparseSession.release``) and recompute. ``request_ids`` names them.
    """

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class BlockAllocator:
    """A free list of engine block ids, for standalone use and tests.

    An engine passes its own allocator instead: anything with ``allocate(n)
    -> list[int]`` (raising ``CapacityError`` when short) and ``free(ids)``.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityError(f"{n} blocks asked, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Sequence[int]) -> None:
        for block in ids:
            if block not in self._used:
                raise InvalidArgument(f"block {block} is not allocated")
            self._used.remove(block)
            self._free.append(block)


def chain_keys(request_id: str, first: int, n: int, salt: bytes = b"") -> list[bytes]:
    """Keys for logical blocks ``first .. first+n-1`` of a request with no prefix hashes.

    Each key hashes the request's identity and the block index, so a
    request's spilled blocks never collide with another's. Engines that
    share prefixes pass their own block hashes instead.
    """
    base = hashlib.sha256(salt + request_id.encode()).digest()
    return [hashlib.sha256(base + i.to_bytes(8, "little")).digest() for i in range(first, first + n)]


@dataclass
class SparseRequest:
    request_id: str
    slot: int  # row of the session's tables; changes when an earlier request ends
    blocks: list[int]  # engine block per logical block, -1 when spilled
    keys: list[bytes]  # one per logical block
    hot_blocks: list[int]  # engine blocks whose rows are this request's hot rows
    host_pages: list[int] = field(default_factory=list)  # region page per logical block, -1
    pins: list[Pin] = field(default_factory=list)
    released: bool = False
    lost: bool = False  # its host pages could not be held again: resolves to -1, release it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_spilled(self) -> int:
        return sum(1 for p in self.host_pages if p >= 0)


class SparseSession:
    """Hot rows and spilled blocks for one engine's requests (see the module docstring)."""

    def __init__(self, client: Client, kv_caches: Sequence[torch.Tensor], allocator: Any, *,
                 hot_rows: int, active_tail_blocks: int = 1, max_blocks: int, max_reqs: int = 64,
                 resolver: Resolver | None = None) -> None:
        layout = client.layout
        if len(kv_caches) != layout.num_layers:
            raise InvalidArgument(f"{len(kv_caches)} KV cache tensors for {layout.num_layers} layers")
        for layer, kv in enumerate(kv_caches):
            if kv.dtype != torch.uint8 or kv.dim() != 2 or kv.shape[1] != layout.row_bytes:
                raise InvalidArgument(f"kv_caches[{layer}] must be uint8 [rows, {layout.row_bytes}]")
        if hot_rows < 1 or active_tail_blocks < 0 or max_blocks < 1 or max_reqs < 1:
            raise InvalidArgument("hot_rows, max_blocks and max_reqs must be positive, "
                                  "active_tail_blocks >= 0")
        self.client = client
        self.layout = layout
        self.kv_caches = list(kv_caches)
        self.allocator = allocator
        self.num_hot_rows = hot_rows
        self.active_tail_blocks = active_tail_blocks
        self.max_blocks = max_blocks
        self.device = kv_caches[0].device
        self.resolver = resolver or _default_resolver(self.device)
        self._salt = os.urandom(8)
        self.requests: dict[str, SparseRequest] = {}
        self.batch: list[SparseRequest] = []  # slot order
        self.max_reqs = max_reqs
        B, NB, H, L, dev = max_reqs, max_blocks, hot_rows, layout.num_layers, self.device
        self.resident_blocks = torch.full((B, NB), -1, dtype=torch.int32, device=dev)
        self.host_pages = torch.full((B, NB), -1, dtype=torch.int64, device=dev)
        self.hot_rows = torch.zeros((B, H), dtype=torch.int32, device=dev)
        self.hot_tags = torch.full((L, B, H), -1, dtype=torch.int32, device=dev)
        self.hot_stamp = torch.zeros((L, B, H), dtype=torch.int64, device=dev)
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=dev)
        self._holds_session: ClientSession = client.session  # every pin below is of this one
        self._host_rows = self._map_host_rows()

    def _map_host_rows(self) -> list[torch.Tensor]:
        device = None if self.device.type == "cpu" else self.device
        return [self.client.layer_rows(layer, device=device) for layer in range(self.layout.num_layers)]

    # -- request lifecycle --

    def add_request(self, request_id: str, blocks: Sequence[int],
                    keys: Sequence[bytes] | None = None) -> SparseRequest:
        """Track a request whose logical blocks are in ``blocks`` (engine block ids)."""
        if request_id in self.requests:
            raise InvalidArgument(f"request {request_id!r} is already tracked")
        if len(blocks) > self.max_blocks:
            raise InvalidArgument(f"{len(blocks)} blocks; this session takes at most {self.max_blocks}")
        if len(self.batch) >= self.max_reqs:
            raise CapacityError(f"the session holds at most {self.max_reqs} requests")
        keys = list(keys) if keys is not None else chain_keys(request_id, 0, len(blocks), self._salt)
        if len(keys) != len(blocks):
            raise InvalidArgument(f"{len(keys)} keys for {len(blocks)} blocks")
        bt = self.layout.block_tokens
        hot_blocks = self.allocator.allocate(-(-self.num_hot_rows // bt))
        rows = [b * bt + t for b in hot_blocks for t in range(bt)][: self.num_hot_rows]
        slot = len(self.batch)
        req = SparseRequest(request_id, slot, list(blocks), keys, hot_blocks, [-1] * len(blocks))
        self.hot_rows[slot] = torch.tensor(rows, dtype=torch.int32)
        if blocks:
            self.resident_blocks[slot, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.requests[request_id] = req
        self.batch.append(req)
        self.num_real_reqs.fill_(len(self.batch))
        return req

    def append_block(self, req: SparseRequest, block: int, key: bytes | None = None) -> None:
        """The request grew by one block (decode filled the last one)."""
        if req.num_blocks >= self.max_blocks:
            raise InvalidArgument(f"request {req.request_id!r} is at max_blocks={self.max_blocks}")
        self.resident_blocks[req.slot, req.num_blocks] = block
        req.blocks.append(block)
        req.host_pages.append(-1)
        req.keys.append(key if key is not None else
                        chain_keys(req.request_id, req.num_blocks - 1, 1, self._salt)[0])

    def spill(self, req: SparseRequest) -> int:
        """Move resident blocks older than the active tail to host pages; returns how many.

        Blocks go in logical order and stop at the first the region cannot
        take (``store`` writes what fits): those stay resident.
        """
        todo = [b for b in range(max(0, req.num_blocks - self.active_tail_blocks))
                if req.blocks[b] >= 0 and req.host_pages[b] < 0]
        if not todo:
            return 0
        keys = [req.keys[b] for b in todo]
        self.check_holds()  # earlier pins first: all of a request's pins under one session
        self.client.store(keys, self._gather_pages([req.blocks[b] for b in todo]))
        pin = self.client.pin(keys)
        if pin._session is not self._holds_session:  # lost between check and pin
            pin.release()
            self.check_holds()
            pin = self.client.pin(keys)
        if pin.count == 0:
            pin.release()
            return 0
        req.pins.append(pin)
        freed, spilled = [], todo[:pin.count]
        for b, page in zip(spilled, pin.page_ids.tolist()):
            req.host_pages[b] = page
            freed.append(req.blocks[b])
            req.blocks[b] = -1
        idx = torch.tensor(spilled, dtype=torch.int64, device=self.device)
        # host page first: a reader of the tables never sees a block in neither place
        self.host_pages[req.slot].index_copy_(0, idx, torch.tensor(
            [req.host_pages[b] for b in spilled], dtype=torch.int64, device=self.device))
        self.resident_blocks[req.slot].index_fill_(0, idx, -1)
        self.allocator.free(freed)
        return len(freed)

    def release(self, req: SparseRequest) -> None:
        """The request ended: unpin its pages, hand back its hot and resident blocks."""
        if req.released:
            return
        req.released = True
        for pin in req.pins:
            pin.release()
        self.allocator.free([b for b in req.blocks if b >= 0] + req.hot_blocks)
        self.requests.pop(req.request_id, None)
        last = self.batch.pop()
        if last is not req:  # keep slots 0..n-1 dense: the last request moves into the hole
            self._move_slot(last.slot, req.slot)
            last.slot = req.slot
            self.batch[req.slot] = last
        self._clear_slot(len(self.batch))
        self.num_real_reqs.fill_(len(self.batch))

    def _move_slot(self, src: int, dst: int) -> None:
        for table in (self.resident_blocks, self.host_pages, self.hot_rows):
            table[dst].copy_(table[src])
        self.hot_tags[:, dst].copy_(self.hot_tags[:, src])
        self.hot_stamp[:, dst].copy_(self.hot_stamp[:, src])

    def _clear_slot(self, slot: int) -> None:
        self.resident_blocks[slot].fill_(-1)
        self.host_pages[slot].fill_(-1)
        self.hot_rows[slot].fill_(0)
        self.hot_tags[:, slot].fill_(-1)
        self.hot_stamp[:, slot].fill_(0)

    def _gather_pages(self, engine_blocks: list[int]) -> torch.Tensor:
        """Logical page bytes ``[n, page_bytes]`` of engine blocks, layer-major per page."""
        bt, rb = self.layout.block_tokens, self.layout.row_bytes
        idx = torch.tensor(engine_blocks, dtype=torch.int64, device=self.device)
        out = torch.empty((len(engine_blocks), self.layout.num_layers, bt * rb), dtype=torch.uint8,
                          device=self.device)
        for layer, kv in enumerate(self.kv_caches):
            out[:, layer, :] = kv.view(-1, bt * rb).index_select(0, idx)
        return out.view(len(engine_blocks), -1)

    # -- the decode step --

    def resolve(self, reqs: Sequence[SparseRequest], layer: int, topk: torch.Tensor,
                step: int | torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical rows of ``topk`` (int32 ``[B, Q, K]``) for one layer; row ``i`` is slot ``i``.

        ``reqs`` is the batch (``self.batch``, in slot order); ``B`` may be
        larger (padding, up to ``max_reqs``). The layer's hot-row state is
        updated in place and missing rows are copied into its KV cache.
        ``step``: an int, or an int64 ``[1]`` device tensor the caller bumps
        (capturable). Returns ``(phys_rows, counters)`` as
        ``hisparse.kernels.resolve`` does.
        """
        if list(reqs) != self.batch:
            raise InvalidArgument("resolve takes the session's batch, in slot order (session.batch)")
        self.check_holds()
        B = topk.shape[0] if topk.dim() == 3 else -1
        if not len(self.batch) <= B <= self.max_reqs:
            raise InvalidArgument(f"topk must be int32 [B, Q, K] with {len(self.batch)} <= B <= "
                                  f"{self.max_reqs}, not {tuple(topk.shape)}")
        if not isinstance(step, torch.Tensor):
            step = torch.tensor([step], dtype=torch.int64, device=self.device)
        kwargs: dict[str, Any] = {"out": out} if out is not None else {}
        # Views of the first B slots: contiguous rows, so the kernel's in-place
        # updates land in the session's own state.
        return self.resolver(
            topk=topk, num_real_reqs=self.num_real_reqs, resident_blocks=self.resident_blocks[:B],
            host_pages=self.host_pages[:B], host_rows=self._host_rows[layer],
            block_tokens=self.layout.block_tokens, hot_rows=self.hot_rows[:B],
            hot_tags=self.hot_tags[layer, :B], hot_stamp=self.hot_stamp[layer, :B], step=step,
            kv_rows=self.kv_caches[layer], **kwargs)


    # -- fencing --

    def check_holds(self) -> None:
        """Make sure every spilled page is held by the client's current session.

        Free when nothing was lost (one read of the fence). Otherwise re-pins
        each request's spilled keys on the current session and rewrites its
        host page table; raises ``RequestsLost`` naming the requests that could
        not be held again (their host pages are cleared first).
        """
        session = self.client.session
        if session is self._holds_session and session.fence.live:
            return
        if not session.fence.live:
            # Lost while this process stalled: a call re-attaches the client.
            try:
                _, session = self.client.request(Op.HEARTBEAT)
            except LeaseExpired:
                session = self.client.session
        lost = [req.request_id for req in self.batch if not req.lost and not self._repin(req)]
        if session.region is not self._holds_session.region:
            self._host_rows = self._map_host_rows()  # the daemon re-created the region
        self._holds_session = session
        if lost:
            raise RequestsLost(f"{len(lost)} requests lost their host pages with their session "
                               f"(lease expiry or daemon restart): {lost[:8]}; release them", lost)

    def _repin(self, req: SparseRequest) -> bool:
        blocks = [b for b, page in enumerate(req.host_pages) if page >= 0]
        if not blocks:
            return True
        keys = [req.keys[b] for b in blocks]
        try:
            pin = self.client.pin(keys)
        except HisparseError:
            pin = None
        if pin is None or pin.count < len(keys):
            if pin is not None:
                pin.release()
            req.lost = True
            self.host_pages[req.slot].fill_(-1)  # rows resolve to -1, never to others' bytes
            return False
        for old in req.pins:
            old.release()
        req.pins = [pin]
        for b, page in zip(blocks, pin.page_ids.tolist()):
            req.host_pages[b] = page
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        self.host_pages[req.slot].index_copy_(0, idx, torch.tensor(
            [req.host_pages[b] for b in blocks], dtype=torch.int64, device=self.device))
        return True


def _default_resolver(device: torch.device) -> Resolver:
    from hisparse import kernels

    return kernels.resolve if device.type == "cuda" else kernels.resolve_reference
