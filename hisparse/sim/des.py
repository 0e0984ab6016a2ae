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
from dataclasses import dataclass

from hisparse.sim import plan
from hisparse.sim.hostpool import HostPool
from hisparse.sim.presets import HostConfig, Scenario


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
        self.hisparsed = mode == "hisparse" and self.host.one_pool  # one region, both roles
        # Indexed by replica; a shared pool is one object in every slot.
        self.park = self._pools(self.host.park_bytes)
        self.sparse = self.park if self.hisparsed else self._pools(self.host.sparse_bytes)
        self.hbm_used = [0] * self.dp
        self.waiting: list[list[_Req]] = [[] for _ in range(self.dp)]
        self.loading: list[_Req] = []
        self.running: list[list[_Req]] = [[] for _ in range(self.dp)]
        expert_bytes = (m.weight_bytes - m.replicated_weight_bytes) / sc.node.gpus
        self.expert_read_s = expert_bytes / (sc.node.hbm_bytes_per_s * sc.perf.hbm_efficiency)
        self.h2d_step_s = (plan.h2d_bytes_per_step(m, e, sc.perf) / sc.node.h2d_bytes_per_s
                           if mode == "hisparse" else 0.0)

    def _pools(self, total_bytes: int) -> list[HostPool]:
        if self.host.shared:
            return [HostPool(total_bytes)] * self.dp
        return [HostPool(total_bytes // self.dp) for _ in range(self.dp)]

    def load(self, replica: int) -> int:
        return len(self.running[replica]) + len(self.waiting[replica]) + sum(
            1 for r in self.loading if r.replica == replica)

    def admit_lookup(self, req: _Req) -> None:
        """What the scheduler asks the connector when it considers ``req``."""
        park, sys = self.park[req.replica], self.sc.workload.shared_prefix_tokens
        prompt = req.total_tokens - self.sc.workload.output_tokens
        # A key chain hashes its whole prefix: without the system prompt's
        # pages, the session's pages behind it cannot be found.
        found = 0 if sys and park.tokens(("sys",)) < sys else max(sys, park.tokens(("s", req.session)))
        req.hit_tokens = min(found, prompt)
        req.prefill_left = prompt - req.hit_tokens

    def pin_hits(self, req: _Req) -> None:
        """Hold the hit pages until they are loaded (one_pool pins them anyway)."""
        if not req.hit_tokens or self.hisparsed:
            return
        park = self.park[req.replica]
        keys = [("sys",)] if self.sc.workload.shared_prefix_tokens else []
        if req.hit_tokens > self.sc.workload.shared_prefix_tokens:
            keys.append(("s", req.session))
        for key in keys:
            assert park.reserve(key, 0, 0, True)
        req.pinned = tuple(keys)

    def unpin_hits(self, req: _Req) -> None:
        for key in req.pinned:
            self.park[req.replica].unpin(key)
        req.pinned = ()

    def _bytes(self, tokens: int) -> int:
        return max(0, tokens - self.sc.workload.shared_prefix_tokens) * self.full_bpt

    def reserve_host(self, req: _Req) -> bool:
        if self.mode != "hisparse":
            return True
        key = ("s", req.session)
        if not self.host.one_pool:
            cold = plan.request_cold_bytes(self.sc.model, self.sc.engine, req.total_tokens)
            return self.sparse[req.replica].reserve(key, req.total_tokens, cold, True)
        pool, sys = self.park[req.replica], self.sc.workload.shared_prefix_tokens
        if sys and not pool.reserve(("sys",), sys, sys * self.full_bpt, True):
            return False
        if pool.reserve(key, req.total_tokens, self._bytes(req.total_tokens), True):
            return True
        if sys:
            pool.unpin(("sys",))
        return False

    def release_host(self, req: _Req) -> None:
        key, sys = ("s", req.session), self.sc.workload.shared_prefix_tokens
        park = self.park[req.replica]
        if self.hisparsed:
            park.unpin(key)
            if sys:
                park.unpin(("sys",))
            return
        if self.mode == "hisparse":
            self.sparse[req.replica].drop(key)
        # Park the session for its next turn (the offload tier's store).
        if sys:
            park.reserve(("sys",), sys, sys * self.full_bpt, False)
        park.reserve(key, req.total_tokens, self._bytes(req.total_tokens), False)

    def hbm_need(self, req: _Req, prefilling: bool) -> int:
        m, e = self.sc.model, self.sc.engine
        need = plan.request_hbm_bytes(m, e, req.total_tokens, self.mode)
        if self.mode == "hisparse" and prefilling:
            # New tokens stay resident until their prefill ends, then spill.
            need += max(0, req.prefill_left - e.tail_tokens) * self.mla_bpt
        return need


class _Sim:
    """The event loop: arrivals, one scheduling pass per step, runs of steps."""

    def __init__(self, sc: Scenario, mode: str, users: int, seed: int) -> None:
        self.sc, self.wl, self.perf = sc, sc.workload, sc.perf
        self.node = _Node(sc, mode, users)
        self.rng = random.Random(seed)
        self.q_tokens = 1 + sc.engine.mtp_depth  # decode query rows per request
        # A rank prefills its own tokens' attention alone; EP spreads their
        # MoE over the node. With dp=1 this is chunk / prefill_tokens_per_s.
        share, rate = self.perf.prefill_attention_share, self.perf.prefill_tokens_per_s
        self.attn_s_per_token = share * self.node.dp / rate
        self.moe_s_per_token = (1.0 - share) / rate
        # (time, user, session, turn, last replica); clients start over the
        # first minute so that they do not move in step.
        self.arrivals = [(self.rng.uniform(0.0, 60.0), u, u, 0, -1) for u in range(users)]
        heapq.heapify(self.arrivals)
        self.next_session = users
        self.now = 0.0
        self.run_area = self.wait_area = self.steps = self.steps_time = 0.0
        self.hit = self.lookupable = self.turns = 0
        self.turn_time = 0.0
        interval = self.wl.restart_interval_s
        self.restart_every_s = interval / self.node.dp if interval > 0 else math.inf
        self.next_restart_s, self.restarts = self.restart_every_s, 0

    def restart_due(self) -> None:
        """Rolling restarts: the next replica's engine restarts, losing a private host pool."""
        node = self.node
        while self.now >= self.next_restart_s:
            r = self.restarts % node.dp
            if not node.host.shared:
                node.park[r].drop_unpinned()
                if node.sparse[r] is not node.park[r]:
                    node.sparse[r].drop_unpinned()
            self.restarts += 1
            self.next_restart_s += self.restart_every_s

    def measured(self, span_s: float) -> float:
        """The part of [now, now + span_s] inside the measured window."""
        sc = self.sc
        return max(0.0, min(self.now + span_s, sc.horizon_s) - max(self.now, sc.warmup_s))

    def route(self, turn: int, last: int) -> int:
        node = self.node
        if node.dp == 1:
            return 0
        if turn > 0 and self.rng.random() >= self.wl.move_prob:
            return last
        others = [r for r in range(node.dp) if r != last]
        low = min(node.load(r) for r in others)
        return self.rng.choice([r for r in others if node.load(r) == low])

    def deliver(self) -> None:
        """Queue the turns that arrived; start the requests whose load ended."""
        node, wl = self.node, self.wl
        while self.arrivals and self.arrivals[0][0] <= self.now:
            _, u, sess, turn, last = heapq.heappop(self.arrivals)
            prompt = plan.prompt_tokens(wl, turn)
            req = _Req(u, sess, turn, self.route(turn, last), prompt + wl.output_tokens, 0, prompt,
                       float(wl.output_tokens), arrival_s=self.now)
            node.waiting[req.replica].append(req)
        for req in [r for r in node.loading if r.ready_s <= self.now]:
            node.loading.remove(req)
            node.unpin_hits(req)
            node.running[req.replica].append(req)

    def admit(self, r: int, req: _Req) -> bool:
        """Admit the head of replica ``r``'s queue if its reservation fits."""
        node, wl = self.node, self.wl
        node.admit_lookup(req)
        need = node.hbm_need(req, True)
        if node.hbm_used[r] + need > node.budget or not node.reserve_host(req):
            return False
        node.waiting[r].pop(0)
        node.pin_hits(req)
        if self.now >= self.sc.warmup_s:
            reusable = (wl.shared_prefix_tokens if req.turn == 0 else
                        plan.prompt_tokens(wl, req.turn - 1) + wl.output_tokens)
            self.hit += min(req.hit_tokens, reusable)
            self.lookupable += reusable
        node.hbm_used[r] += need
        req.hbm_bytes = need
        return True

    def schedule(self, r: int) -> tuple[int, int, float]:
        """vLLM's pass over replica ``r``: decodes, prefill chunks, admissions.
        -> (decode tokens, prefill tokens, the replica's own step seconds)"""
        node, running = self.node, self.node.running[r]
        n_dec = sum(1 for q in running if q.prefill_left == 0)
        budget = self.sc.engine.max_num_batched_tokens - n_dec * self.q_tokens
        for q in running:
            if q.prefill_left:
                q.chunk = min(q.prefill_left, max(0, budget))
                budget -= q.chunk
        while node.waiting[r] and budget > 0:
            req = node.waiting[r][0]
            if not self.admit(r, req):
                break  # head-of-line blocking, as in vLLM
            load_s = req.hit_tokens * node.full_bpt / self.sc.node.h2d_bytes_per_s
            if load_s > 0:
                req.ready_s = self.now + load_s
                node.loading.append(req)
                continue
            req.chunk = min(req.prefill_left, budget)
            budget -= req.chunk
            running.append(req)
        pf = sum(q.chunk for q in running if q.prefill_left)
        own_s = (self.perf.step_per_request_s * len(running) + pf * self.attn_s_per_token
                 + n_dec * node.h2d_step_s)
        return n_dec * self.q_tokens, pf, own_s

    def steps_until_change(self, dt: float, next_event: float) -> int:
        """Steps until an arrival, a load's end, a decode's end or a new chunk size."""
        k = max(1, math.ceil((next_event - self.now) / dt))
        for q in (q for run in self.node.running for q in run):
            if q.prefill_left == 0:
                k = min(k, math.ceil(q.decode_left / self.perf.accept_tokens_per_step))
            elif q.chunk:
                k = min(k, q.prefill_left // q.chunk if q.prefill_left > q.chunk else 1)
        return k

    def advance(self, k: int) -> None:
        """Apply ``k`` identical steps to every running request."""
        node = self.node
        for r in range(node.dp):
            for q in list(node.running[r]):
                if q.prefill_left == 0:
                    q.decode_left -= k * self.perf.accept_tokens_per_step
                    if q.decode_left <= 1e-9:
                        self.finish(r, q)
                elif q.chunk:
                    q.prefill_left -= k * q.chunk
                    assert q.prefill_left >= 0
                    if q.prefill_left == 0:
                        # Spill the prefilled tokens: keep only the steady set.
                        keep = node.hbm_need(q, False)
                        node.hbm_used[r] -= q.hbm_bytes - keep
                        q.hbm_bytes = keep
                    q.chunk = 0

    def finish(self, r: int, q: _Req) -> None:
        node, wl = self.node, self.wl  # free the turn, park it, schedule the next
        node.running[r].remove(q)
        node.hbm_used[r] -= q.hbm_bytes
        node.release_host(q)
        if self.sc.warmup_s <= self.now <= self.sc.horizon_s:
            self.turns += 1
            self.turn_time += self.now - q.arrival_s
        nxt = (q.user, q.session, q.turn + 1, r)
        if q.turn + 1 == wl.turns:
            nxt = (q.user, self.next_session, 0, r)
            self.next_session += 1
        heapq.heappush(self.arrivals, (self.now + self.rng.expovariate(1.0 / wl.gap_s), *nxt))

    def run(self) -> None:
        node, sc = self.node, self.sc
        while self.now < sc.horizon_s:
            self.restart_due()
            self.deliver()
            passes = [self.schedule(r) for r in range(node.dp)]
            not_running = sum(map(len, node.waiting)) + len(node.loading)
            next_event = min([a[0] for a in self.arrivals[:1]] + [q.ready_s for q in node.loading]
                             + [min(self.next_restart_s, sc.horizon_s)])
            if not any(node.running):
                self.wait_area += not_running * self.measured(max(next_event - self.now, 0.0))
                self.now = max(next_event, self.now)
                if not self.arrivals and not node.loading:
                    break
                continue
            # DP ranks step in lockstep: shared costs plus the slowest rank.
            dec_tokens = sum(p[0] for p in passes)
            m = sc.model
            touched = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** dec_tokens
            dt = (self.perf.step_fixed_s + node.expert_read_s * touched
                  + max(p[2] for p in passes) + sum(p[1] for p in passes) * self.moe_s_per_token)
            k = self.steps_until_change(dt, next_event)
            span = self.measured(k * dt)
            self.run_area += sum(map(len, node.running)) * span
            self.wait_area += not_running * span
            if sc.warmup_s <= self.now < sc.horizon_s:
                self.steps += k
                self.steps_time += k * dt
            self.now += k * dt
            self.advance(k)

    def result(self) -> SimResult:
        window = self.sc.horizon_s - self.sc.warmup_s
        return SimResult(
            mode=self.node.mode, users=self.node.users, mean_running=self.run_area / window,
            mean_waiting=self.wait_area / window,
            host_hit_rate=self.hit / self.lookupable if self.lookupable else 1.0,
            turns_per_min=60.0 * self.turns / window,
            mean_turn_s=self.turn_time / self.turns if self.turns else 0.0,
            mean_step_s=self.steps_time / self.steps if self.steps else 0.0)


def simulate(sc: Scenario, mode: str, users: int, seed: int | None = None) -> SimResult:
    """Run ``users`` closed-loop clients in ``mode`` ("full" or "hisparse")."""
    if mode not in plan.MODES:
        raise ValueError(f"unknown mode {mode!r}")
    sim = _Sim(sc, mode, users, sc.seed if seed is None else seed)
    sim.run()
    return sim.result()
