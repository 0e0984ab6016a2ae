"""``vllm serve`` (vLLM 0.32's CPU build) with the OpenAI client: two servers on one hisparsed.

A multi-turn chat alternates between the servers, so each later turn lands
on a server that never saw the conversation's last prompt: its cached tokens
come from the tier. Then hisparsed is killed (SIGKILL) mid-run and started
again: docs/vllm.md, "vLLM 0.32", says what a 0.32 engine does then. No load
is in flight at the kill (turns are sequential), so: every request is
answered while the daemon is away (lookups miss, stores are skipped), the
restarted daemon adopts every committed page, and the engines' hits resume.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from hisparse.vllm.cpu.model import sample_texts
from hisparse.vllm.cpu.serve import Server
from tests.vllm_cpu.conftest import committed_pages, stats, wait_committed

# The module's engines start in its first test's setup: several engine starts on a busy box.
pytestmark = pytest.mark.timeout(1200)
pytest.importorskip("openai")

BLOCK_TOKENS = 128  # vLLM CPU_ATTN's block size: one hisparse page per 128 tokens


@pytest.fixture(scope="module")
def servers(tiny_model: str, module_daemon: Any, tmp_path_factory: Any) -> Iterator[list[Server]]:
    tmp = tmp_path_factory.mktemp("serve")
    made = [Server(tiny_model, module_daemon.socket, str(tmp / f"serve-{i}.log")) for i in range(2)]
    try:
        for server in made:
            server.wait_ready()  # both start at once
        yield made
    finally:
        for server in made:
            server.close()


def _conversation(seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": " ".join(sample_texts(30, seed=seed))}]


def _chat(servers: list[Server], messages: list[dict[str, str]], turns: int, first: int = 0,
          daemon: Any = None) -> list[tuple[int, int, bool]]:
    """``turns`` turns alternating between the servers: (prompt tokens, cached, stored) per turn.

    With ``daemon``, each turn's new prompt blocks are committed before the next turn goes
    out: a store is asynchronous (it lands after the reply), and a router would not wait for
    it, but a test of what the next engine finds must. ``stored`` is False when some of them
    were skipped (``wait_committed``): the next turn's hits are then not judged."""
    seen: list[tuple[int, int, bool]] = []
    for t in range(turns):
        before = committed_pages(daemon.socket) if daemon is not None else 0
        messages.append({"role": "user", "content": f"turn {t}: " + sample_texts(1, seed=100 + t)[0]})
        answer, prompt, cached = servers[(first + t) % 2].turn(messages)
        messages.append({"role": "assistant", "content": answer})
        stored = True
        if daemon is not None:  # the blocks this turn added to the conversation's chain
            new = (_whole_blocks(prompt) - (_whole_blocks(seen[-1][0]) if seen else 0)) // BLOCK_TOKENS
            stored = wait_committed(daemon.socket, before + new)
        seen.append((prompt, cached, stored and (not seen or seen[-1][2])))
    return seen


def _whole_blocks(tokens: int) -> int:
    return tokens // BLOCK_TOKENS * BLOCK_TOKENS


def _schedulers_polling(socket: str) -> int:
    """Schedulers whose background thread talks to the daemon (it refreshes its mirror every
    few milliseconds once a round succeeds: from then on its lookups hit)."""
    rows = stats(socket).get("sessions", [])
    return sum(1 for r in rows if "scheduler" in r["client"] and r["state"] == "live" and r["idle_s"] < 0.5)


def test_later_turns_of_a_chat_hit_the_tier_on_the_other_server(servers: list[Server], module_daemon: Any) -> None:
    seen = _chat(servers, _conversation(seed=3), turns=4, daemon=module_daemon)
    assert seen[0][1] == 0  # the first turn: nothing anywhere
    judged = [(prev, cur) for prev, cur in zip(seen, seen[1:]) if prev[2]]
    assert judged, f"every turn's stores were skipped: {seen}"
    for (prev_prompt, _, _), (_, cached, _) in judged:
        # This server never ran the previous turn: at least that turn's whole prompt blocks
        # (stored by the other server) came from hisparsed.
        assert cached >= _whole_blocks(prev_prompt) - BLOCK_TOKENS, seen


def test_daemon_killed_and_restarted_mid_run(servers: list[Server], module_daemon: Any) -> None:
    # A conversation stored through the tier before the kill.
    before = _conversation(seed=5)
    first = _chat(servers, before, turns=1, first=0, daemon=module_daemon)
    module_daemon.kill()
    # Away: every request is answered; its lookups miss and its stores are skipped.
    away = _chat(servers, _conversation(seed=6), turns=2, first=0)
    assert away[0][1] == 0
    for server in servers:
        assert server.proc.poll() is None  # a 0.32 engine keeps running (no load was in flight)
    module_daemon.start()  # the same socket and directories: it adopts every committed page
    deadline = time.monotonic() + 60
    while _schedulers_polling(module_daemon.socket) < 2:  # both have the daemon back
        assert time.monotonic() < deadline, "the engines did not re-attach to the restarted daemon"
        time.sleep(0.2)
    # The second turn of the stored conversation, on the server that never saw it: from the tier.
    again = _chat(servers, before, turns=1, first=1)
    if first[0][2]:  # every block of the first turn was stored before the kill
        assert again[0][1] >= _whole_blocks(first[0][0]) - BLOCK_TOKENS, (first, again)
    else:  # some were skipped (a busy box): the chain's stored head is still found
        assert again[0][1] > 0, (first, again)
