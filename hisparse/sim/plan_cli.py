"""``hisparse plan``: parse the command line, run the capacity model and the
simulation, print a table (or ``--json``), draw ``--plot``.

Scenarios (``--scenario``): ``glm53-8xh200`` (the published setup, the
default), ``glm53-8xh200-shared-pool`` (one hisparsed pool for 8 DP
replicas against 8 private pools), ``glm5-1m`` (1M-token context, TP8
against DP-attention). Flags override a scenario's inputs; ``--model`` and
``--gpu`` pick presets (``hisparse.sim.presets``). The published GLM-5.3
figures are shown only for the setup they were measured on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from typing import Any

from hisparse.errors import MissingExtra
from hisparse.sim import des, fit, plan
from hisparse.sim.presets import GPUS, MODELS, SCENARIOS, GiB, HostConfig, Scenario, gpu_named

PUBLISHED_C32 = {"baseline": (5.0, 6.0), "hisparse": (19.0, 25.0)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hisparse plan",
        description="Capacity planner: running requests, host memory and PCIe time per decode step "
                    "of a node serving a sparse-attention model, with and without the sparse tier, "
                    "from a closed-form model and a discrete-event simulation.",
        epilog="docs/planner.md derives every formula.")
    p.add_argument("--scenario", default="glm53-8xh200", choices=sorted(SCENARIOS),
                   help="workload and setup to start from (default glm53-8xh200, the published one)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="FILE.png", help="draw running requests against concurrency "
                   "(needs matplotlib: pip install 'hisparse[plot]')")
    g = p.add_argument_group("overrides (default: the scenario's)")
    g.add_argument("--model", choices=sorted(MODELS), help="model preset (KV geometry and weights)")
    g.add_argument("--gpu", choices=sorted(GPUS), help="GPU preset: HBM size and bandwidth")
    g.add_argument("--gpus", type=int, help="GPUs in the node")
    g.add_argument("--hbm-gib", type=float, help="HBM per GPU (overrides --gpu's)")
    g.add_argument("--weight-gb", type=float, help="whole checkpoint, 1e9 bytes")
    g.add_argument("--tp", type=int, help="tensor parallel size of a replica")
    g.add_argument("--dp", type=int, help="DP-attention replicas (tp x dp = GPUs)")
    g.add_argument("--kv-format", choices=("fp8_ds_mla", "bf16"), help="KV cache dtype")
    g.add_argument("--gpu-memory-utilization", type=float, help="vLLM's share of HBM")
    g.add_argument("--workspace-gib", type=float, help="HBM per GPU besides weights and KV")
    g.add_argument("--mtp", type=int, help="MTP depth (speculative tokens)")
    g.add_argument("--hot-rows", type=int, help="hot rows per layer per request")
    g.add_argument("--host-gib", type=float, help="host memory for KV (both modes)")
    g.add_argument("--sparse-gib", type=float, help="of it, hisparse's pool for running requests")
    g.add_argument("--first-turn", type=int, help="tokens of a session's first prompt")
    g.add_argument("--turn-increment", type=int, help="prompt growth per turn")
    g.add_argument("--output", type=int, help="reply tokens per turn")
    g.add_argument("--turns", type=int, help="turns per session")
    g.add_argument("--gap-s", type=float, help="mean tool/think gap between turns")
    g.add_argument("--miss-rate", type=float, help="sparse-tier misses / selected rows")
    g.add_argument("--measure-miss-rate", action="store_true",
                   help="measure the miss rate on generated top-k traces with the reference "
                        "resolver (hisparse/sim/hitrate.py) instead of assuming it")
    g.add_argument("--concurrency", type=lambda s: tuple(int(x) for x in s.split(",")),
                   metavar="C1,C2,...", help="concurrent sessions to simulate")
    g.add_argument("--seed", type=int, help="random seed of the simulation")
    return p


def _set(obj: Any, **changes: Any) -> Any:
    changes = {k: v for k, v in changes.items() if v is not None}
    return replace(obj, **changes) if changes else obj


def scenario_from_args(a: argparse.Namespace) -> Scenario:
    sc = SCENARIOS[a.scenario]
    model = MODELS[a.model] if a.model else sc.model
    if a.weight_gb is not None:
        model = replace(model, weight_bytes=int(a.weight_gb * 1e9))
    node = sc.node
    if a.gpu is not None:
        gpu = GPUS[a.gpu]
        node = replace(node, hbm_bytes=gpu.hbm_bytes, hbm_bytes_per_s=gpu.hbm_bytes_per_s,
                       h2d_bytes_per_s=gpu.h2d_bytes_per_s)
    hbm = int(a.hbm_gib * GiB) if a.hbm_gib is not None else None
    ws = int(a.workspace_gib * GiB) if a.workspace_gib is not None else None
    sc = replace(
        sc, model=model, node=_set(node, gpus=a.gpus, hbm_bytes=hbm),
        engine=_set(sc.engine, tp=a.tp, dp=a.dp, kv_format=a.kv_format, mtp_depth=a.mtp,
                    gpu_memory_utilization=a.gpu_memory_utilization, workspace_bytes=ws,
                    hot_rows=a.hot_rows),
        workload=_set(sc.workload, first_turn_tokens=a.first_turn, turns=a.turns,
                      turn_increment_tokens=a.turn_increment, output_tokens=a.output,
                      gap_s=a.gap_s),
        perf=_set(sc.perf, miss_rate=a.miss_rate),
        concurrency=a.concurrency or sc.concurrency, seed=sc.seed if a.seed is None else a.seed)
    if a.host_gib is not None or a.sparse_gib is not None:
        host = int(a.host_gib * GiB) if a.host_gib is not None else (
            sc.hisparse_host.park_bytes + sc.hisparse_host.sparse_bytes)
        sparse = int(a.sparse_gib * GiB) if a.sparse_gib is not None else sc.hisparse_host.sparse_bytes
        hs = sc.hisparse_host
        sc = replace(sc, baseline_host=HostConfig(park_bytes=host),
                     hisparse_host=replace(hs, park_bytes=host - (0 if hs.one_pool else sparse),
                                           sparse_bytes=0 if hs.one_pool else sparse))
    return sc


def inputs(sc: Scenario) -> dict[str, Any]:
    return {k: asdict(getattr(sc, k)) for k in
            ("model", "node", "engine", "workload", "perf", "baseline_host", "hisparse_host")} | {
        "seed": sc.seed, "warmup_s": sc.warmup_s, "horizon_s": sc.horizon_s}


def is_published_setup(sc: Scenario) -> bool:
    """The setup the published GLM-5.3 figures were measured on (workload aside)."""
    ref = SCENARIOS["glm53-8xh200"]
    return (sc.model == ref.model and sc.node == ref.node and sc.engine == ref.engine
            and sc.workload == ref.workload)


def header(sc: Scenario) -> str:
    """What is being planned: the scenario as named, or the presets and overrides chosen."""
    if sc == replace(SCENARIOS[sc.name], concurrency=sc.concurrency, seed=sc.seed, perf=sc.perf):
        return f"{sc.name}: {sc.description}"
    n, e = sc.node, sc.engine
    return (f"{sc.model.name} on {n.gpus} x {gpu_named(n.hbm_bytes)} ({n.hbm_bytes / GiB:.1f} GiB), "
            f"TP{e.tp} x DP{e.dp}, MTP{e.mtp_depth}, {e.kv_format} KV; "
            f"workload and host memory of scenario {sc.name}")


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def arithmetic(sc: Scenario, tokens: int, users: int) -> tuple[plan.Capacity, list[str]]:
    """The closed-form answer for requests of ``tokens`` tokens, as printed lines."""
    m, n, e, perf = sc.model, sc.node, sc.engine, sc.perf
    cap = plan.capacity(m, n, e, perf, tokens, sc.hisparse_host, users)
    ml, il = plan.mla_layers(m, e), plan.indexer_layers(m, e)
    # The MTP drafter is one more decoder layer with its own KV (and indexer) rows.
    mtp = f" ({m.num_layers} + {ml - m.num_layers} MTP)" if ml > m.num_layers else ""
    imtp = f" ({m.indexer_layers} + {il - m.indexer_layers} MTP)" if il > m.indexer_layers else ""
    row, mla, idx = plan.kv_row_bytes(e), plan.mla_bytes_per_token(m, e), plan.indexer_bytes_per_token(m, e)
    rep = m.replicated_weight_bytes
    hot, tail = e.hot_rows * mla, min(tokens, e.tail_tokens) * mla
    distinct = m.topk_rows * (1 + e.mtp_depth * perf.draft_novelty)
    lines = [
        f"layout TP{e.tp} x DP{e.dp} on {n.gpus} GPUs; MLA KV replicated on each of a replica's {e.tp} TP ranks",
        f"weights/GPU = {rep / 1e9:.0f} GB non-expert / TP{e.tp} + {(m.weight_bytes - rep) / 1e9:.0f} GB experts"
        f" / {n.gpus} = {_gib(cap.weight_bytes_per_gpu)}",
        f"KV budget/GPU = {e.gpu_memory_utilization} x {_gib(n.hbm_bytes)} - weights"
        f" - workspace {_gib(e.workspace_bytes)} = {_gib(cap.kv_budget_bytes)}",
        f"bytes/token = {ml} layers{mtp} x {row} B + {il} indexer layers{imtp} x 132 B = {mla:,} + {idx:,}"
        f" = {mla + idx:,} B",
        f"full residency: {tokens:,} tok x {mla + idx:,} B = {_gib(cap.full_request_bytes)}/request"
        f" -> {e.dp} x floor(budget / that) = {cap.full_running} running",
        f"hisparse HBM/request = indexer {_gib(tokens * idx)} + hot {e.hot_rows} rows x {mla:,} B"
        f" {_gib(hot)} + tail {min(tokens, e.tail_tokens)} tok {_gib(tail)}"
        f" = {_gib(cap.hisparse_request_bytes)} -> {cap.hisparse_hbm_running} by HBM",
        f"hisparse host/request = ({tokens:,} - {e.tail_tokens}) tok x {mla:,} B"
        f" = {_gib(cap.cold_request_bytes)} -> {cap.hisparse_host_running} by host"
        f" -> {cap.hisparse_running} running",
        (f"host needed for {users} session{'s' * (users != 1)}: full residency"
         f" {_gib(cap.full_host_bytes_needed)}, hisparse {_gib(cap.hisparse_host_bytes_needed)}"
         if users else "host needed: none, as no request runs"),
        f"H2D/decode step = {perf.miss_rate:.0%} miss x {distinct:.0f} distinct rows x {ml} layers"
        f" x {row} B = {cap.h2d_bytes_per_step / 1e6:.1f} MB/request/GPU"
        f" = {cap.h2d_bytes_per_step / n.h2d_bytes_per_s * 1e3:.2f} ms at"
        f" {n.h2d_bytes_per_s / 1e9:.0f} GB/s; {cap.h2d_s_per_step * 1e3:.1f} ms/step per GPU at"
        f" {min(cap.hisparse_running, users)} running",
    ]
    return cap, lines


def run_published(sc: Scenario) -> dict[str, Any]:
    base = [des.simulate(sc, "full", c) for c in sc.concurrency]
    hs = [des.simulate(sc, "hisparse", c) for c in sc.concurrency]
    tokens = round(plan.mean_turn_tokens(sc.workload))
    cap, _ = arithmetic(sc, tokens, max(sc.concurrency, default=1))
    return {
        "scenario": sc.name, "concurrency": list(sc.concurrency),
        "baseline_running": [round(r.mean_running, 2) for r in base],
        "hisparse_running": [round(r.mean_running, 2) for r in hs],
        "baseline": [asdict(r) for r in base], "hisparse": [asdict(r) for r in hs],
        "published_at_c32": PUBLISHED_C32 if is_published_setup(sc) else None,
        "capacity_at_mean_turn": asdict(cap),
        "inputs": inputs(sc)}


def print_published(sc: Scenario, out: dict[str, Any]) -> None:
    wl = sc.workload
    print(header(sc))
    print(f"workload: {wl.turns} turns, first {wl.first_turn_tokens:,} tokens, +{wl.turn_increment_tokens}"
          f"/turn, {wl.output_tokens} out, gap {wl.gap_s} s; last turn {plan.final_tokens(wl):,} tokens")
    tokens = round(plan.mean_turn_tokens(wl))
    print(f"closed form, every request at the mean turn's {tokens:,} tokens ('running' = fit at once):")
    for line in arithmetic(sc, tokens, max(sc.concurrency))[1]:
        print("  " + line)
    print(f"\nsimulated: c closed-loop users; num_requests_running averaged over"
          f" {sc.horizon_s - sc.warmup_s:.0f} s after {sc.warmup_s:.0f} s warm-up")
    print(f"{'c':>4} {'baseline':>9} {'hisparse':>9} {'base turns/min':>15} {'hs turns/min':>13}"
          f" {'hs step ms':>11}")
    for c, b, h in zip(out["concurrency"], out["baseline"], out["hisparse"]):
        print(f"{c:>4} {b['mean_running']:>9.2f} {h['mean_running']:>9.2f} {b['turns_per_min']:>15.1f}"
              f" {h['turns_per_min']:>13.1f} {h['mean_step_s'] * 1e3:>11.1f}")
    if out["published_at_c32"] is not None:
        print("published at c=32: baseline 5-6, hisparse 19-25")


SHARED_POOL_RESTART_S = 1800.0  # rolling restarts: each replica once per half hour


def run_shared_pool(sc: Scenario) -> dict[str, Any]:
    rows = []
    cases = [(move, 0.0, c) for move in (0.0, sc.workload.move_prob, 1.0) for c in sc.concurrency]
    cases.append((sc.workload.move_prob, SHARED_POOL_RESTART_S, sc.concurrency[0]))
    for move, restart_s, c in cases:
        s = replace(sc, workload=replace(sc.workload, move_prob=move, restart_interval_s=restart_s))
        for shared in (True, False):
            host = replace(s.hisparse_host, shared=shared)
            r = des.simulate(replace(s, hisparse_host=host), "hisparse", c)
            rows.append({"pool": "shared" if shared else "per-replica", "move_prob": move,
                         "restart_interval_s": restart_s} | asdict(r))
    return {"scenario": sc.name, "rows": rows, "inputs": inputs(sc)}


def print_shared_pool(sc: Scenario, out: dict[str, Any]) -> None:
    print(header(sc))
    print(f"  {sc.engine.dp} replicas; host {_gib(sc.hisparse_host.park_bytes)} as one pool, or"
          f" {sc.engine.dp} x {_gib(sc.hisparse_host.park_bytes // sc.engine.dp)};"
          f" system prompt {sc.workload.shared_prefix_tokens:,} tokens")
    print("  shared: vLLM HiSparse with kv_connector_module_path=hisparse.vllm.hisparse_connector"
          " (one hisparsed namespace); per-replica: vLLM's own HiSparse host pools")
    print("  move: share of turns routed to another replica than the session's last one;"
          " restart: each replica restarts once per this interval, staggered (- = never)")
    print(f"{'pool':>12} {'move':>5} {'restart':>8} {'c':>4} {'running':>8} {'host hit':>9}"
          f" {'turns/min':>10} {'turn s':>7}")
    for r in out["rows"]:
        restart = f"{r['restart_interval_s']:.0f}s" if r["restart_interval_s"] else "-"
        print(f"{r['pool']:>12} {r['move_prob']:>5.2f} {restart:>8} {r['users']:>4}"
              f" {r['mean_running']:>8.2f} {r['host_hit_rate']:>9.1%} {r['turns_per_min']:>10.1f}"
              f" {r['mean_turn_s']:>7.1f}")


def run_long_context(sc: Scenario) -> dict[str, Any]:
    tokens = sc.workload.first_turn_tokens + sc.workload.output_tokens
    host = HostConfig(park_bytes=sc.baseline_host.park_bytes, one_pool=True)
    layouts, summary = {}, []
    # The scenario's model in full, then GLM-5.3 (22 indexer layers) for contrast.
    models = [sc.model] + [MODELS["glm-5.3"]] * (sc.model.name != "glm-5.3")
    for model in models:
        for tp, dp in ((sc.node.gpus, 1), (1, sc.node.gpus)):
            s = replace(sc, model=model, engine=replace(sc.engine, tp=tp, dp=dp), hisparse_host=host)
            name = f"TP{tp}" if dp == 1 else f"DP{dp}-attention"
            # host for the requests that run (none when not one fits)
            users = plan.capacity(s.model, s.node, s.engine, s.perf, tokens, host, 1).hisparse_running
            cap, lines = arithmetic(s, tokens, users)
            fits = tokens * plan.full_bytes_per_token(model, s.engine) <= cap.kv_budget_bytes
            lines.append(f"max_model_len {s.engine.max_model_len:,} under full residency: " + (
                "fits" if fits else "vLLM refuses to start (one request exceeds the KV budget)"))
            summary.append({"model": model.name, "layout": name, "full_running": cap.full_running,
                            "hisparse_hbm_running": cap.hisparse_hbm_running,
                            "hisparse_host_running": cap.hisparse_host_running,
                            "hisparse_running": cap.hisparse_running})
            if model is sc.model:
                layouts[name] = {"capacity": asdict(cap), "arithmetic": lines}
    return {"scenario": sc.name, "tokens": tokens, "layouts": layouts, "summary": summary,
            "inputs": inputs(sc)}


def print_long_context(sc: Scenario, out: dict[str, Any]) -> None:
    print(f"{header(sc)}; {out['tokens']:,}-token requests,"
          f" {_gib(sc.baseline_host.park_bytes)} host as one pool")
    for name, lay in out["layouts"].items():
        print(f"\n{sc.model.name} {name}:")
        for line in lay["arithmetic"]:
            print("  " + line)
    print(f"\n{'model':>8} {'layout':>16} {'full':>5} {'hisparse':>9}  (HBM-bound, host-bound)")
    for r in out["summary"]:
        print(f"{r['model']:>8} {r['layout']:>16} {r['full_running']:>5} {r['hisparse_running']:>9}"
              f"  ({r['hisparse_hbm_running']}, {r['hisparse_host_running']})")


def plot_path_error(path: str) -> str | None:
    """None, or why ``--plot`` could not write ``path`` (checked before the simulation runs)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"no directory {folder}: create it (mkdir -p {folder}) or plot elsewhere"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"may not write into {folder}: plot elsewhere"
    if os.path.isdir(path):
        return "is a directory: name a file, e.g. plan.png"
    return None


def plot(out: dict[str, Any], path: str) -> None:
    """Draw the sweep to ``path``; ``MissingExtra`` without matplotlib."""
    from hisparse.extras import require

    matplotlib = require("matplotlib", "hisparse plan --plot")

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    c = out["concurrency"]
    ax.plot(c, out["baseline_running"], "o-", label="full residency (offload parks idle sessions)")
    ax.plot(c, out["hisparse_running"], "s-", label="hisparse (sparse tier in host memory)")
    if out["published_at_c32"] is not None:
        for (lo, hi), color in zip(PUBLISHED_C32.values(), ("C0", "C1")):
            ax.fill_between([30.5, 33.5], lo, hi, color=color, alpha=0.25)
        ax.plot([], [], " ", label="shaded: published range at c=32")
    ax.set_xlabel("concurrent sessions (c)")
    ax.set_ylabel("mean num_requests_running")
    i = out["inputs"]
    ax.set_title(f"{i['model']['name']}, {i['node']['gpus']} x {gpu_named(i['node']['hbm_bytes'])},"
                 f" TP{i['engine']['tp']}, MTP{i['engine']['mtp_depth']}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_RUNNERS = {
    "glm53-8xh200-shared-pool": (run_shared_pool, print_shared_pool),
    "glm5-1m": (run_long_context, print_long_context),
}


def with_measured_miss_rate(sc: Scenario, *, quiet: bool = False) -> Scenario:
    """``sc`` with its miss rate measured on a trace shaped by its own top-k, hot rows and MTP."""
    from hisparse.sim.hitrate import measure_miss_rate

    e = sc.engine
    got = measure_miss_rate(topk=sc.model.topk_rows, hot_factor=e.hot_rows / sc.model.topk_rows,
                            mtp=e.mtp_depth, context_tokens=sc.workload.first_turn_tokens)
    if not quiet:
        print(f"miss rate measured on generated traces (overlap 0.90, {e.hot_rows} hot rows, "
              f"MTP{e.mtp_depth}, {got.steps} steps x {got.requests} requests): {got.miss_rate:.2%}"
              f" (assumed otherwise: {sc.perf.miss_rate:.0%})\n")
    return replace(sc, perf=replace(sc.perf, miss_rate=got.miss_rate))


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sc = scenario_from_args(a)
        refusal = fit.layout_error(sc) or fit.weights_error(sc)
        if refusal is not None:
            print(f"hisparse plan: {refusal}", file=sys.stderr)
            return 2
        if a.plot and (bad := plot_path_error(a.plot)):
            print(f"hisparse plan: --plot {a.plot}: {bad}", file=sys.stderr)
            return 2
        if a.plot and _RUNNERS.get(sc.name, (run_published,))[0] is not run_published:
            print(f"hisparse plan: --plot draws a concurrency sweep; scenario {sc.name} has none "
                  "(use glm53-8xh200 or its overrides)", file=sys.stderr)
            return 2
        if a.measure_miss_rate:
            sc = with_measured_miss_rate(sc, quiet=a.json)
        run, show = _RUNNERS.get(sc.name, (run_published, print_published))
        out = run(sc)
    except ValueError as exc:
        print(f"hisparse plan: {exc}", file=sys.stderr)
        return 2
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        show(sc, out)
    if a.plot:
        try:
            plot(out, a.plot)
        except MissingExtra as exc:
            print(f"hisparse plan: no plot: {exc}", file=sys.stderr)
            return 1
        print(f"plot: {os.path.abspath(a.plot)}", file=sys.stderr if a.json else sys.stdout)
    return 0
