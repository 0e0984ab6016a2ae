"""A seedable generator of DSA-like top-k traces, for hit-rate studies of the sparse tier.

DeepSeek-V3.2's lightning indexer scores every past token for each query and
sparse MLA attends to the top ``K`` (2048). What matters to a hot-row cache is
how that selection moves from one decode step to the next, so this models the
selection, not the scores' meaning:

- **Candidates.** Per request, a pool of ``candidate_factor * topk`` positions
  that the indexer may rank high: clusters (runs of adjacent tokens, length
  geometric with mean ``mean_cluster_tokens``) placed by a Zipf law over
  ``num_segments`` segments of the context, so a few regions (the question,
  a hot document) draw most clusters and most of the context none. A
  ``cluster_score_weight`` share of each score is common to its cluster, so
  passages are selected as runs, not as scattered tokens.
- **Drift.** Each candidate has a score per indexer group that follows AR(1),
  ``s' = rho * s + sqrt(1 - rho^2) * eps``. ``rho`` is calibrated (Monte
  Carlo, cached) so that the overlap of one query row's top-k between adjacent
  steps, ``|S_t & S_t+1| / K``, is about ``target_overlap`` (default 0.90,
  sweepable 0.80-0.97) once sinks and the recent window are counted.
- **Sinks and recent window.** The first ``sink_tokens`` and the last
  ``recent_window`` positions are always selected, as attention sinks and the
  local window are in practice; they take top-k slots from the pool.
- **Growth.** The context grows by ``tokens_per_step`` (default ``1 + mtp``)
  per step; a new token joins the candidate pool with ``new_candidate_prob``.
- **Shift events.** With ``shift_prob`` per request per step, the topic
  shifts: ``shift_fraction`` of the candidates move to fresh clusters with
  fresh scores, and the overlap dips for a step.
- **Groups.** ``num_groups`` indexer groups (layers that share one top-k, or
  layers seen by one cache) have scores correlated by ``group_correlation``:
  their innovations share a common part.
- **MTP.** ``mtp`` draft tokens add query rows (``Q = 1 + mtp``); row ``q``
  sees ``q`` more tokens and scores the pool with independent noise of scale
  ``mtp_noise``, so rows overlap heavily but not fully, as drafts do.

``TopkTrace(params).step()`` returns int32 ``[num_requests, num_groups, Q, K]``
positions, distinct within a row, ``-1`` where the context is shorter than K.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TraceParams:
    """Parameters of a trace; each line says what it models."""

    num_requests: int = 4             # concurrent decode requests
    num_groups: int = 1               # indexer groups, each with its own top-k
    context_tokens: int = 80_000      # context length at the first step
    topk: int = 2048                  # K: positions selected per query row
    mtp: int = 0                      # MTP draft tokens: Q = 1 + mtp query rows
    tokens_per_step: int | None = None  # context growth per step (default 1 + mtp)
    target_overlap: float = 0.90      # adjacent-step overlap of a row's top-k
    candidate_factor: float = 4.0     # candidate pool size in units of topk
    mean_cluster_tokens: float = 16.0  # mean length of a candidate cluster (geometric)
    cluster_score_weight: float = 0.7  # share of a score's variance common to its cluster
    zipf_exponent: float = 1.2        # skew of cluster placement over segments
    num_segments: int = 256           # context segments that clusters are placed in
    sink_tokens: int = 4              # leading positions always selected
    recent_window: int = 128          # trailing positions always selected
    shift_prob: float = 0.002         # per request and step: chance of a topic shift
    shift_fraction: float = 0.5       # share of candidates a shift relocates
    group_correlation: float = 0.8    # correlation of score innovations across groups
    mtp_noise: float = 0.2            # score noise of draft rows against row 0
    new_candidate_prob: float = 0.05  # chance a new token joins the candidate pool
    seed: int = 0

    @property
    def q_rows(self) -> int:
        return 1 + self.mtp

    @property
    def growth(self) -> int:
        return self.tokens_per_step if self.tokens_per_step is not None else 1 + self.mtp


@functools.lru_cache(maxsize=64)
def calibrate_rho(n: int, k: int, target: float, trials: int = 6, seed: int = 1234) -> float:
    """The AR(1) coefficient whose top-``k`` of ``n`` overlaps ``target`` step to step.

    Overlap grows with rho, so bisect on a fixed set of Monte Carlo draws.
    """
    if k >= n or target <= 0.0:
        return 0.0
    if target >= 1.0:
        return 1.0
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((trials, n))
    z = rng.standard_normal((trials, n))
    top_x = [set(np.argpartition(-row, k - 1)[:k].tolist()) for row in x]

    def overlap(rho: float) -> float:
        y = rho * x + np.sqrt(1.0 - rho * rho) * z
        return float(np.mean([len(top_x[t] & set(np.argpartition(-y[t], k - 1)[:k].tolist())) / k
                              for t in range(trials)]))

    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if overlap(mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of ``|a_row & b_row| / K`` for position arrays ``[..., K]`` (-1 ignored)."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    total = 0.0
    for ra, rb in zip(a2, b2):
        total += np.intersect1d(ra[ra >= 0], rb[rb >= 0]).size / a.shape[-1]
    return total / a2.shape[0]


class _Request:
    """One request's candidate pool: positions, their clusters, and scores.

    A candidate's score is a cluster part plus its own part, both AR(1) with
    the same ``rho`` (so their sum is too): adjacent tokens of one passage
    rise and fall together, as the indexer's scores of a relevant span do.
    """

    def __init__(self, p: TraceParams, rng: np.random.Generator) -> None:
        self.p, self.rng = p, rng
        self.context = p.context_tokens
        self.segment_order = rng.permutation(p.num_segments)
        self.pos, self.cid = self._clusters(int(p.candidate_factor * p.topk), self.context, first_id=0)
        self.cscore = self._correlated(int(self.cid.max(initial=-1)) + 1)
        self.tscore = self._correlated(self.pos.size)

    def _correlated(self, n: int) -> np.ndarray:
        """``[G, n]`` unit normals whose groups correlate by ``group_correlation``."""
        c, rng, g = self.p.group_correlation, self.rng, self.p.num_groups
        return np.sqrt(c) * rng.standard_normal(n) + np.sqrt(1.0 - c) * rng.standard_normal((g, n))

    def _clusters(self, want: int, context: int, first_id: int,
                  avoid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``want`` distinct positions in clusters Zipf-placed over segments, and cluster ids."""
        p, rng = self.p, self.rng
        lo = min(p.sink_tokens, context)
        span = max(context - lo, 1)
        ranks = np.arange(1, p.num_segments + 1, dtype=np.float64) ** -p.zipf_exponent
        prob = ranks / ranks.sum()
        want = min(want, span - (0 if avoid is None else avoid.size))
        pos, cid = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        while pos.size < want:
            n_new = max(8, int((want - pos.size) / p.mean_cluster_tokens) + 1)
            seg = self.segment_order[rng.choice(p.num_segments, size=n_new, p=prob)]
            start = lo + ((seg + rng.random(n_new)) * span / p.num_segments).astype(np.int64)
            length = rng.geometric(1.0 / p.mean_cluster_tokens, size=n_new)
            runs = np.concatenate([np.arange(a, a + n) for a, n in zip(start, length)])
            ids = np.repeat(first_id + np.arange(n_new), length)
            first_id += n_new
            ok = (runs < context) & ~np.isin(runs, pos)
            if avoid is not None:
                ok &= ~np.isin(runs, avoid)
            runs, at = np.unique(runs[ok], return_index=True)  # overlapping runs: first wins
            pos, cid = np.concatenate([pos, runs]), np.concatenate([cid, ids[ok][at]])
        keep = rng.permutation(pos.size)[:want]
        return pos[keep], cid[keep]

    def scores(self) -> np.ndarray:
        w = self.p.cluster_score_weight
        return np.sqrt(w) * self.cscore[:, self.cid] + np.sqrt(1.0 - w) * self.tscore

    def advance(self, rho: float) -> None:
        """One step of drift, growth and maybe a shift."""
        p, rng = self.p, self.rng
        keep_var = np.sqrt(1.0 - rho * rho)
        self.cscore = rho * self.cscore + keep_var * self._correlated(self.cscore.shape[1])
        self.tscore = rho * self.tscore + keep_var * self._correlated(self.tscore.shape[1])
        if rng.random() < p.shift_prob:
            moved = rng.random(self.pos.size) < p.shift_fraction
            fresh, fresh_cid = self._clusters(int(moved.sum()), self.context, self.cscore.shape[1],
                                              avoid=self.pos[~moved])
            n_cl = int(fresh_cid.max(initial=self.cscore.shape[1] - 1)) + 1 - self.cscore.shape[1]
            self._append(fresh, fresh_cid, keep=~moved, new_clusters=n_cl)
        new = np.arange(self.context, self.context + p.growth)
        joins = new[rng.random(new.size) < p.new_candidate_prob]
        self._append(joins, self.cscore.shape[1] + np.arange(joins.size), keep=None, new_clusters=joins.size)
        self.context += p.growth

    def _append(self, pos: np.ndarray, cid: np.ndarray, keep: np.ndarray | None, new_clusters: int) -> None:
        if keep is not None:
            self.pos, self.cid, self.tscore = self.pos[keep], self.cid[keep], self.tscore[:, keep]
        self.pos, self.cid = np.concatenate([self.pos, pos]), np.concatenate([self.cid, cid])
        self.tscore = np.concatenate([self.tscore, self._correlated(pos.size)], axis=1)
        self.cscore = np.concatenate([self.cscore, self._correlated(new_clusters)], axis=1)

    def select(self) -> np.ndarray:
        """``[G, Q, K]`` positions for the current context."""
        p, rng = self.p, self.rng
        out = np.full((p.num_groups, p.q_rows, p.topk), -1, dtype=np.int32)
        scores = self.scores()
        for q in range(p.q_rows):
            end = self.context + q  # row q also sees the q drafts before it
            forced = np.union1d(np.arange(min(p.sink_tokens, end)),
                                np.arange(max(end - p.recent_window, 0), end))[: p.topk]
            free = p.topk - forced.size
            pool = ~np.isin(self.pos, forced) & (self.pos < end)
            for g in range(p.num_groups):
                score = scores[g]
                if q > 0:
                    score = score + p.mtp_noise * rng.standard_normal(score.size)
                score = np.where(pool, score, -np.inf)
                take = min(free, int(pool.sum()))
                best = np.argpartition(-score, take - 1)[:take] if take > 0 else np.zeros(0, np.int64)
                row = np.concatenate([forced, self.pos[best]])
                out[g, q, : row.size] = row
        return out


class TopkTrace:
    """Steps of top-k selections for ``num_requests`` requests (see the module docstring)."""

    def __init__(self, params: TraceParams) -> None:
        self.params = params
        seeds = np.random.SeedSequence(params.seed).spawn(params.num_requests)
        self.requests = [_Request(params, np.random.default_rng(s)) for s in seeds]
        self.rho = calibrate_rho(int(params.candidate_factor * params.topk), self._pool_k(),
                                 self._pool_target())

    def _pool_k(self) -> int:
        p = self.params
        return max(p.topk - p.sink_tokens - p.recent_window, 1)

    def _pool_target(self) -> float:
        """The pool's own overlap that makes a whole row's overlap ``target_overlap``.

        Sinks always stay; the recent window keeps all but the ``growth``
        tokens that slid out of it.
        """
        p = self.params
        fixed = min(p.sink_tokens + max(p.recent_window - p.growth, 0), p.topk)
        return float(np.clip((p.target_overlap * p.topk - fixed) / self._pool_k(), 0.0, 1.0))

    @property
    def context_tokens(self) -> np.ndarray:
        """Each request's context length for the next ``step()``."""
        return np.array([r.context for r in self.requests], dtype=np.int64)

    def step(self) -> np.ndarray:
        """The next step's selection, int32 ``[num_requests, num_groups, Q, K]``."""
        out = np.stack([r.select() for r in self.requests])
        for r in self.requests:
            r.advance(self.rho)
        return out
