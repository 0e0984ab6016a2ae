"""Equivalence of two resolve results up to the choices the contract leaves free.

The contract fixes every resident and hot row, the counters, and that victims
are least recently used, but not which missing position takes which victim,
nor the order among equal stamps, nor which positions get victims when there
are too few. So ``resolve`` is compared with ``resolve_reference`` through the
invariants instead of bytes:

- counters equal; padded requests all ``-1``, zero counters, state untouched;
- every entry's row equals the reference's unless the position was loaded by
  either side; -1 entries stay -1; every occurrence of a position shares a row;
- each loaded position owns a distinct victim ``h``: ``hot_rows[b, h]`` is its
  row, its tag is the position, its stamp ``step``, and the row's bytes are the
  position's host row;
- no victim was hit; no victim had a larger stamp before the step than a
  candidate left alone;
- hot rows that are not victims end with the reference's tag and stamp;
  rows of ``kv_rows`` that no victim owns are unchanged.

Used by the interpreter tests and by ``benchmarks/resolve_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import torch

STATE = ("hot_tags", "hot_stamp", "kv_rows")


def snapshot(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of a resolve call's arguments, taken before the call."""
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


def compare(
    before: dict[str, Any],
    ref: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
    got: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
    max_problems: int = 20,
) -> list[str]:
    """Problems found in ``got`` against ``ref``; empty when they are equivalent.

    ``before`` is ``snapshot(kwargs)``; ``ref`` and ``got`` are
    ``(phys_rows, counters, {"hot_tags", "hot_stamp", "kv_rows"})`` after each call.
    """
    ref_rows, ref_cnt, ref_state = _cpu(ref)
    got_rows, got_cnt, got_state = _cpu(got)
    problems: list[str] = []
    batch = before["topk"].shape[0]
    num_real = min(int(before["num_real_reqs"].reshape(-1)[0]), batch)
    touched = torch.zeros(before["kv_rows"].shape[0], dtype=torch.bool)
    if not torch.equal(ref_cnt, got_cnt):
        b = int(torch.nonzero((ref_cnt != got_cnt).any(1))[0])
        problems.append(f"counters differ, first at request {b}: ref {ref_cnt[b].tolist()} got {got_cnt[b].tolist()}")
    for b in range(batch):
        if b >= num_real:
            problems += _check_padded(b, before, got_rows, got_cnt, got_state)
        else:
            problems += _check_request(b, before, ref_rows, ref_state, got_rows, got_state, touched)
        if len(problems) >= max_problems:
            break
    untouched = ~touched
    if not torch.equal(got_state["kv_rows"][untouched], before["kv_rows"][untouched]):
        problems.append("kv_rows changed outside the victims' rows")
    return problems[:max_problems]


def assert_equivalent(before: dict[str, Any], ref: Any, got: Any) -> None:
    """``compare`` as an assertion, listing the first problems."""
    problems = compare(before, ref, got)
    assert not problems, "resolve differs from the reference:\n  " + "\n  ".join(problems)


def _cpu(res: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    rows, cnt, state = res
    return rows.cpu(), cnt.cpu(), {k: state[k].cpu() for k in STATE}


def _check_padded(b: int, before: dict[str, Any], rows: torch.Tensor, cnt: torch.Tensor,
                  state: dict[str, torch.Tensor]) -> list[str]:
    out = []
    if not bool((rows[b] == -1).all()):
        out.append(f"padded request {b} has rows other than -1")
    if bool(cnt[b].any()):
        out.append(f"padded request {b} has counters {cnt[b].tolist()}")
    for k in ("hot_tags", "hot_stamp"):
        if not torch.equal(state[k][b], before[k][b]):
            out.append(f"padded request {b}: {k} changed")
    return out


def _check_request(b: int, before: dict[str, Any], ref_rows: torch.Tensor,
                   ref_state: dict[str, torch.Tensor], got_rows: torch.Tensor,
                   got_state: dict[str, torch.Tensor], touched: torch.Tensor) -> list[str]:
    out: list[str] = []
    bt = int(before["block_tokens"])
    step = int(before["step"].reshape(-1)[0])
    pos = before["topk"][b].reshape(-1).long()
    ref_r = ref_rows[b].reshape(-1).long()
    got_r = got_rows[b].reshape(-1).long()
    hot_rows = before["hot_rows"][b].long()
    tags0, stamp0 = before["hot_tags"][b].long(), before["hot_stamp"][b]
    tags1, stamp1 = got_state["hot_tags"][b].long(), got_state["hot_stamp"][b]
    if bool((got_r[pos < 0] != -1).any()):
        out.append(f"request {b}: an entry of -1 got a row")

    # Classify U from the state before the step, as the contract does.
    valid = pos >= 0
    u, inv = torch.unique(pos[valid], return_inverse=True)
    first = torch.zeros(u.numel(), dtype=torch.long)
    first.scatter_(0, inv, torch.arange(inv.numel()))  # some occurrence of each position
    got_u = got_r[valid][first]
    if not torch.equal(got_r[valid], got_u[inv]):
        out.append(f"request {b}: occurrences of one position got different rows")
    nb = before["resident_blocks"].shape[1]
    in_table = u // bt < nb
    blk = torch.where(in_table, u // bt, 0)
    resident = in_table & (before["resident_blocks"][b][blk] >= 0)
    match = u[:, None] == tags0[None, :]
    hit_u = in_table & ~resident & match.any(1)
    # A position is "loaded" by a side when it was neither resident nor hot
    # and still got a row; which ones get rows is free when victims run out.
    ref_u = ref_r[valid][first]
    ref_loaded = ~resident & ~hit_u & (ref_u != -1)
    got_loaded = ~resident & ~hit_u & (got_u != -1)
    fixed = ~ref_loaded & ~got_loaded
    if not torch.equal(ref_u[fixed], got_u[fixed]):
        bad = u[fixed][ref_u[fixed] != got_u[fixed]][:5].tolist()
        out.append(f"request {b}: resident/hot/overflow rows differ at positions {bad}")

    # Victims of got: the h owning each loaded row.
    row_to_h = {int(r): h for h, r in enumerate(hot_rows.tolist())}
    if any(int(r) not in row_to_h for r in got_u[got_loaded].tolist()):
        return out + [f"request {b}: a loaded position got a row that is none of its hot rows"]
    victims = [row_to_h[int(r)] for r in got_u[got_loaded].tolist()]
    if len(set(victims)) != len(victims):
        out.append(f"request {b}: two loaded positions share a victim")
    out += _check_loaded(b, u[got_loaded], torch.tensor(victims, dtype=torch.long), before, got_state, bt, step)
    hit = torch.zeros(tags0.numel(), dtype=torch.bool)
    if bool(hit_u.any()):
        hit[match[hit_u].int().argmax(1)] = True  # the smallest h holding the tag
    vic = torch.zeros_like(hit)
    vic[torch.tensor(victims, dtype=torch.long)] = True
    if bool((vic & hit).any()):
        out.append(f"request {b}: a row hit this step was taken as a victim")
    left = ~vic & ~hit
    if bool(vic.any()) and bool(left.any()) and int(stamp0[vic].max()) > int(stamp0[left].min()):
        out.append(f"request {b}: a victim is more recent than a row left alone")
    ref_vic = torch.zeros_like(hit)
    ref_vic[torch.tensor([row_to_h.get(int(r), 0) for r in ref_u[ref_loaded].tolist()], dtype=torch.long)] = True
    same = ~vic & ~ref_vic
    if not torch.equal(tags1[same], ref_state["hot_tags"][b].long()[same]) or \
            not torch.equal(stamp1[same], ref_state["hot_stamp"][b][same]):
        out.append(f"request {b}: tags/stamps of rows that are no victim differ from the reference")
    only_ref = ref_vic & ~vic
    if not torch.equal(tags1[only_ref], tags0[only_ref]) or not torch.equal(stamp1[only_ref], stamp0[only_ref]):
        out.append(f"request {b}: a row neither hit nor taken changed state")
    touched[hot_rows[vic]] = True
    return out


def _check_loaded(b: int, pos: torch.Tensor, vic: torch.Tensor, before: dict[str, Any],
                  got_state: dict[str, torch.Tensor], bt: int, step: int) -> list[str]:
    """Each loaded position ``pos[i]`` owns victim ``vic[i]``: tag, stamp and bytes."""
    if pos.numel() == 0:
        return []
    out = []
    nb = before["host_pages"].shape[1]
    in_table = pos // bt < nb
    blk = torch.where(in_table, pos // bt, 0)
    page = torch.where(in_table, before["host_pages"][b][blk], -1)
    if bool((page < 0).any()):
        return [f"request {b}: positions {pos[page < 0][:5].tolist()} loaded without a host page"]
    if bool((before["resident_blocks"][b][blk] >= 0).any()):
        out.append(f"request {b}: a resident position was loaded")
    tags, stamps = got_state["hot_tags"][b][vic].long(), got_state["hot_stamp"][b][vic]
    if not torch.equal(tags, pos) or bool((stamps != step).any()):
        out.append(f"request {b}: victims of loaded positions lack their new tag or stamp")
    rows = before["hot_rows"][b][vic].long()
    if not torch.equal(got_state["kv_rows"][rows], before["host_rows"][page * bt + pos % bt]):
        out.append(f"request {b}: a loaded row does not hold its host row")
    return out
