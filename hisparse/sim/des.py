"""Discrete-event simulation of multi-turn sessions on one node.

Closed loop: ``users`` clients each run 13-turn sessions back to back. A
turn arrives, waits in its replica's FIFO queue, is admitted when its HBM
(and host) reservation fits, loads its cached prefix from host, prefills
its new tokens in chunks, decodes its reply, then the client thinks for an
exponential tool gap and sends the next turn. ``mean_running`` is the time
average of admitted, loaded requests (prefilling or decoding): what vLLM's
``num_requests_running`` gauge reports.

The engine advances in steps like vLLM's scheduler: decodes first, then
prefill chunks in admission order, then new admissions while the token
budget lasts; a head-of-line request that does not fit blocks the queue.
DP replicas step in lockstep (their MoE all-to-all couples them), so one
step lasts as long as its slowest replica. Between events the batch does
not change, so the loop jumps over whole runs of identical steps.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from dataclasses import dataclass

from hisparse.sim import plan
from hisparse.sim.presets import HostConfig, Scenario


class HostPool:
    """A byte budget of host memory with LRU eviction of unpinned entries."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.pinned_bytes = 0
        self._entries: OrderedDict[tuple, list[int]] = OrderedDict()  # key -> [tokens, bytes, pins]

    def tokens(self, key: tuple) -> int:
        """Tokens held under ``key`` (0 if absent). Looking is not using:
        only ``reserve`` (a store, or the pin before a load) refreshes LRU."""
        entry = self._entries.get(key)
        return entry[0] if entry else 0

    def reserve(self, key: tuple, tokens: int, nbytes: int, pin: bool) -> bool:
        """Grow or create ``key`` to ``nbytes``, evicting LRU unpinned entries.
        False, changing nothing, when pinned entries leave no room."""
        entry = self._entries.get(key)
        old_bytes, pins = (entry[1], entry[2]) if entry else (0, 0)
        nbytes = max(nbytes, old_bytes)
        other_pinned = self.pinned_bytes - (old_bytes if pins else 0)
        if other_pinned + nbytes > self.capacity_bytes:
            return False
        for victim in list(self._entries):
            if self.used_bytes - old_bytes + nbytes <= self.capacity_bytes:
                break
            if victim != key and self._entries[victim][2] == 0:
                self.used_bytes -= self._entries.pop(victim)[1]
        if pins:
            self.pinned_bytes -= old_bytes
        pins += int(pin)
        self.used_bytes += nbytes - old_bytes
        self.pinned_bytes += nbytes if pins else 0
        self._entries[key] = [max(tokens, entry[0] if entry else 0), nbytes, pins]
        self._entries.move_to_end(key)
        return True

    def unpin(self, key: tuple) -> None:
        entry = self._entries[key]
        assert entry[2] > 0, key
        entry[2] -= 1
        if entry[2] == 0:
            self.pinned_bytes -= entry[1]

    def drop(self, key: tuple) -> None:
        entry = self._entries.pop(key)
        self.used_bytes -= entry[1]
        if entry[2]:
            self.pinned_bytes -= entry[1]


@dataclass
class _Req:
    user: int
    session: int
    turn: int
    replica: int
    total_tokens: int       # prompt + reply: KV tokens at the end of the turn
    hit_tokens: int         # prefix found in the host tier, known at admission
    prefill_left: int
    decode_left: float
    arrival_s: float = 0.0
    hbm_bytes: int = 0
    ready_s: float = 0.0    # end of the prefix load
    pinned: tuple = ()      # park-pool keys held for the load
    chunk: int = 0          # prefill tokens scheduled in the current step


@dataclass(frozen=True)
class SimResult:
    mode: str
    users: int
    mean_running: float
    mean_waiting: float     # queued or loading: not yet running
    host_hit_rate: float    # reusable prompt tokens found in host memory
    turns_per_min: float    # turns finished per minute in the measured window
    mean_turn_s: float      # arrival to last token, turns finished in the window
    mean_step_s: float


class _Node:
    """Engine state of every replica plus the host pools."""

    def __init__(self, sc: Scenario, mode: str, users: int) -> None:
        self.sc, self.mode, self.users = sc, mode, users
        m, e = sc.model, sc.engine
        self.dp = e.dp
        self.budget = plan.kv_budget_bytes(m, sc.node, e)
        self.full_bpt = plan.full_bytes_per_token(m, e)
        self.mla_bpt = plan.mla_bytes_per_token(m, e)
        self.host: HostConfig = sc.hisparse_host if mode == "hisparse" else sc.baseline_host
        pools = 1 if self.host.shared else self.dp
        self.park = [HostPool(self.host.park_bytes // pools) for _ in range(pools)]
        self.sparse = ([HostPool(self.host.sparse_bytes // pools) for _ in range(pools)]
                       if mode == "hisparse" and not self.host.one_pool else self.park)
        self.hbm_used = [0] * self.dp
        self.waiting: list[list[_Req]] = [[] for _ in range(self.dp)]
        self.loading: list[_Req] = []
        self.running: list[list[_Req]] = [[] for _ in range(self.dp)]
        expert_bytes = (m.weight_bytes - m.replicated_weight_bytes) / sc.node.gpus
        self.expert_read_s = expert_bytes / (sc.node.hbm_bytes_per_s * sc.perf.hbm_efficiency)
        self.h2d_step_s = (plan.h2d_bytes_per_step(m, e, sc.perf) / sc.node.h2d_bytes_per_s
                           if mode == "hisparse" else 0.0)

    def pool(self, pools: list[HostPool], replica: int) -> HostPool:
        return pools[0] if len(pools) == 1 else pools[replica]

    def load(self, replica: int) -> int:
        return len(self.running[replica]) + len(self.waiting[replica]) + sum(
            1 for r in self.loading if r.replica == replica)

    # -- host tier -------------------------------------------------------
    def lookup(self, req: _Req) -> int:
        park = self.pool(self.park, req.replica)
        sys = self.sc.workload.shared_prefix_tokens
        # A key chain hashes its whole prefix: without the system prompt's
        # pages, the session's pages behind it cannot be found.
        if sys and park.tokens(("sys",)) < sys:
            return 0
        return max(sys, park.tokens(("s", req.session)))

    def admit_lookup(self, req: _Req) -> None:
        """What the scheduler asks the connector when it considers ``req``."""
        prompt = req.total_tokens - self.sc.workload.output_tokens
        req.hit_tokens = min(self.lookup(req), prompt)
        req.prefill_left = prompt - req.hit_tokens

    def pin_hits(self, req: _Req) -> None:
        """Hold the hit pages until they are loaded (one_pool pins them anyway)."""
        if not req.hit_tokens or (self.mode == "hisparse" and self.host.one_pool):
            return
        park = self.pool(self.park, req.replica)
        keys = [("sys",)] if self.sc.workload.shared_prefix_tokens else []
        if req.hit_tokens > self.sc.workload.shared_prefix_tokens:
            keys.append(("s", req.session))
        for key in keys:
            assert park.reserve(key, 0, 0, True)
        req.pinned = tuple(keys)

    def unpin_hits(self, req: _Req) -> None:
        for key in req.pinned:
            self.pool(self.park, req.replica).unpin(key)
        req.pinned = ()

    def _bytes(self, tokens: int) -> int:
        return max(0, tokens - self.sc.workload.shared_prefix_tokens) * self.full_bpt

    def reserve_host(self, req: _Req) -> bool:
        if self.mode != "hisparse":
            return True
        key = ("s", req.session)
        if not self.host.one_pool:
            cold = plan.request_cold_bytes(self.sc.model, self.sc.engine, req.total_tokens)
            return self.pool(self.sparse, req.replica).reserve(key, req.total_tokens, cold, True)
        pool, sys = self.pool(self.park, req.replica), self.sc.workload.shared_prefix_tokens
        if sys and not pool.reserve(("sys",), sys, sys * self.full_bpt, True):
            return False
        if pool.reserve(key, req.total_tokens, self._bytes(req.total_tokens), True):
            return True
        if sys:
            pool.unpin(("sys",))
        return False

    def release_host(self, req: _Req) -> None:
        key, sys = ("s", req.session), self.sc.workload.shared_prefix_tokens
        park = self.pool(self.park, req.replica)
        if self.mode == "hisparse" and self.host.one_pool:
            park.unpin(key)
            if sys:
                park.unpin(("sys",))
            return
        if self.mode == "hisparse":
            self.pool(self.sparse, req.replica).drop(key)
        # Park the session for its next turn (the offload tier's store).
        if sys:
            park.reserve(("sys",), sys, sys * self.full_bpt, False)
        park.reserve(key, req.total_tokens, self._bytes(req.total_tokens), False)

    # -- HBM -------------------------------------------------------------
    def hbm_need(self, req: _Req, prefilling: bool) -> int:
        m, e = self.sc.model, self.sc.engine
        need = plan.request_hbm_bytes(m, e, req.total_tokens, self.mode)
        if self.mode == "hisparse" and prefilling:
            # New tokens stay resident until their prefill ends, then spill.
            need += max(0, req.prefill_left - e.tail_tokens) * self.mla_bpt
        return need


def simulate(sc: Scenario, mode: str, users: int, seed: int | None = None) -> SimResult:
    """Run ``users`` closed-loop clients in ``mode`` ("full" or "hisparse")."""
    wl, perf, eng = sc.workload, sc.perf, sc.engine
    rng = random.Random(sc.seed if seed is None else seed)
    node = _Node(sc, mode, users)
    q_tokens = 1 + eng.mtp_depth
    # A rank prefills its own tokens' attention alone; EP spreads their MoE
    # over the node. With dp=1 this is chunk / prefill_tokens_per_s.
    attn_s_per_token = perf.prefill_attention_share * node.dp / perf.prefill_tokens_per_s
    moe_s_per_token = (1.0 - perf.prefill_attention_share) / perf.prefill_tokens_per_s
    arrivals: list[tuple[float, int, int, int, int]] = []  # (time, user, session, turn, last replica)
    # Start clients over the first minute so that they do not move in step.
    for u in range(users):
        heapq.heappush(arrivals, (rng.uniform(0.0, 60.0), u, u, 0, -1))
    next_session = users
    now = 0.0
    run_area = wait_area = 0.0
    steps = steps_time = 0.0
    hit = lookupable = 0
    turns = 0
    turn_time = 0.0

    def measured(t0: float, t1: float) -> float:
        return max(0.0, min(t1, sc.horizon_s) - max(t0, sc.warmup_s))

    def route(turn: int, last: int) -> int:
        if node.dp == 1:
            return 0
        if turn > 0 and rng.random() >= wl.move_prob:
            return last
        others = [r for r in range(node.dp) if r != last]
        low = min(node.load(r) for r in others)
        return rng.choice([r for r in others if node.load(r) == low])

    while now < sc.horizon_s:
        while arrivals and arrivals[0][0] <= now:
            _, u, sess, turn, last = heapq.heappop(arrivals)
            prompt = plan.prompt_tokens(wl, turn)
            req = _Req(u, sess, turn, route(turn, last), prompt + wl.output_tokens, 0, prompt,
                       float(wl.output_tokens), arrival_s=now)
            node.waiting[req.replica].append(req)
        for req in [r for r in node.loading if r.ready_s <= now]:
            node.loading.remove(req)
            node.unpin_hits(req)
            node.running[req.replica].append(req)

        # Schedule one step on every replica.
        dec_tokens = pf_total = 0
        worst_s = 0.0
        for r in range(node.dp):
            budget = eng.max_num_batched_tokens
            running = node.running[r]
            n_dec = sum(1 for q in running if q.prefill_left == 0)
            budget -= n_dec * q_tokens
            for q in running:
                if q.prefill_left:
                    q.chunk = min(q.prefill_left, max(0, budget))
                    budget -= q.chunk
            while node.waiting[r] and budget > 0:
                req = node.waiting[r][0]
                node.admit_lookup(req)
                need = node.hbm_need(req, True)
                if node.hbm_used[r] + need > node.budget or not node.reserve_host(req):
                    break
                node.waiting[r].pop(0)
                node.pin_hits(req)
                if now >= sc.warmup_s:
                    reusable = (wl.shared_prefix_tokens if req.turn == 0 else
                                plan.prompt_tokens(wl, req.turn - 1) + wl.output_tokens)
                    hit += min(req.hit_tokens, reusable)
                    lookupable += reusable
                node.hbm_used[r] += need
                req.hbm_bytes = need
                load_s = req.hit_tokens * node.full_bpt / sc.node.h2d_bytes_per_s
                if load_s > 0:
                    req.ready_s = now + load_s
                    node.loading.append(req)
                    continue
                req.chunk = min(req.prefill_left, budget)
                budget -= req.chunk
                running.append(req)
            pf = sum(q.chunk for q in running if q.prefill_left)
            dec_tokens += n_dec * q_tokens
            pf_total += pf
            worst_s = max(worst_s, perf.step_per_request_s * len(running)
                          + pf * attn_s_per_token + n_dec * node.h2d_step_s)

        busy = any(node.running)
        next_event = min([a[0] for a in arrivals[:1]] + [q.ready_s for q in node.loading],
                         default=sc.horizon_s)
        if not busy:
            wait_area += sum(map(len, node.waiting)) * measured(now, max(next_event, now))
            now = max(next_event, now)
            if not arrivals and not node.loading:
                break
            continue
        m = sc.model
        touched = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** dec_tokens
        dt = perf.step_fixed_s + node.expert_read_s * touched + worst_s + pf_total * moe_s_per_token
        k = max(1, math.ceil((next_event - now) / dt))
        for q in (q for run in node.running for q in run):
            if q.prefill_left == 0:
                k = min(k, math.ceil(q.decode_left / perf.accept_tokens_per_step))
            elif q.chunk:
                k = min(k, q.prefill_left // q.chunk if q.prefill_left > q.chunk else 1)
        span = k * dt
        n_run = sum(map(len, node.running))
        run_area += n_run * measured(now, now + span)
        wait_area += (sum(map(len, node.waiting)) + len(node.loading)) * measured(now, now + span)
        if sc.warmup_s <= now < sc.horizon_s:
            steps += k
            steps_time += span
        now += span

        for r in range(node.dp):
            for q in list(node.running[r]):
                if q.prefill_left == 0:
                    q.decode_left -= k * perf.accept_tokens_per_step
                    if q.decode_left > 1e-9:
                        continue
                    node.running[r].remove(q)
                    node.hbm_used[r] -= q.hbm_bytes
                    node.release_host(q)
                    if sc.warmup_s <= now <= sc.horizon_s:
                        turns += 1
                        turn_time += now - q.arrival_s
                    nxt = (q.user, q.session, q.turn + 1, r)
                    if q.turn + 1 == wl.turns:
                        nxt = (q.user, next_session, 0, r)
                        next_session += 1
                    heapq.heappush(arrivals, (now + rng.expovariate(1.0 / wl.gap_s), *nxt))
                elif q.chunk:
                    q.prefill_left -= k * q.chunk
                    assert q.prefill_left >= 0
                    if q.prefill_left == 0:
                        # Spill the prefilled tokens: keep only the steady set.
                        keep = node.hbm_need(q, False)
                        node.hbm_used[r] -= q.hbm_bytes - keep
                        q.hbm_bytes = keep
                    q.chunk = 0

    window = sc.horizon_s - sc.warmup_s
    return SimResult(mode=mode, users=users, mean_running=run_area / window,
                     mean_waiting=wait_area / window,
                     host_hit_rate=hit / lookupable if lookupable else 1.0,
                     turns_per_min=60.0 * turns / window,
                     mean_turn_s=turn_time / turns if turns else 0.0,
                     mean_step_s=steps_time / steps if steps else 0.0)
