"""Whether a planned setup can run at all, and if not, a change that makes it run.

``hisparse plan`` refuses a setup whose parallel layout does not cover the
node (``tp x dp != gpus``) or whose weights leave no HBM for KV, before any
simulation. Every suggestion it prints is one this module has checked: the
flags it names, added to the same command, give a setup that fits.
"""

from __future__ import annotations

from dataclasses import replace

from hisparse.sim import plan
from hisparse.sim.presets import GPUS, GiB, Scenario, gpu_named

MAX_NODE_GPUS = 64  # the largest --gpus a suggestion may name
MAX_UTILIZATION = 0.95  # above this vLLM leaves too little for CUDA itself


def layout_error(sc: Scenario) -> str | None:
    """None, or why ``tp x dp`` does not cover the node's GPUs, with flags that do.

    The layouts that also leave HBM for KV are named first; if none does, every one that covers.
    """
    n, e = sc.node, sc.engine
    if e.tp * e.dp == n.gpus:
        return None
    layouts = [(n.gpus // e.tp, e.tp)] if n.gpus % e.tp == 0 else []
    layouts += [(dp, n.gpus // dp) for dp in range(1, n.gpus + 1)
                if n.gpus % dp == 0 and (dp, n.gpus // dp) not in layouts and n.gpus // dp <= e.tp * 2]
    fitting = [(dp, tp) for dp, tp in layouts if _fits(replace(sc, engine=replace(e, tp=tp, dp=dp)))]
    named = [f"--tp {tp} --dp {dp}" for dp, tp in (fitting or layouts)[:2]]
    return (f"tp*dp = {e.tp}*{e.dp} != {n.gpus} GPUs: a replica's TP ranks times the replicas must "
            f"be --gpus. Add {' or '.join(named)}"
            + ("" if fitting else " (neither leaves HBM for KV: see the message without --gpus)"))


def _fits(sc: Scenario) -> bool:
    return plan.kv_budget_bytes(sc.model, sc.node, sc.engine) > 0


def _more_gpus(sc: Scenario) -> str | None:
    """``--gpus N --dp D``: the fewest more replicas of the same TP that leave room for KV."""
    n, e = sc.node, sc.engine
    for dp in range(e.dp + 1, MAX_NODE_GPUS // e.tp + 1):
        if _fits(replace(sc, node=replace(n, gpus=e.tp * dp), engine=replace(e, dp=dp))):
            return f"--gpus {e.tp * dp} --dp {dp}"
    return None


def _larger_gpu(sc: Scenario) -> str | None:
    """``--gpu NAME``: the smallest preset that fits with the same layout."""
    n = sc.node
    for name, gpu in sorted(GPUS.items(), key=lambda item: item[1].hbm_bytes):
        if gpu.hbm_bytes > n.hbm_bytes and _fits(replace(sc, node=replace(n, hbm_bytes=gpu.hbm_bytes))):
            return f"--gpu {name}"
    return None


def _more_memory(sc: Scenario) -> str | None:
    """``--gpu-memory-utilization U``: the least share up to ``MAX_UTILIZATION`` that fits."""
    e = sc.engine
    for hundredths in range(round(e.gpu_memory_utilization * 100) + 1, round(MAX_UTILIZATION * 100) + 1):
        u = hundredths / 100
        if _fits(replace(sc, engine=replace(e, gpu_memory_utilization=u))):
            return f"--gpu-memory-utilization {u}"
    return None


def weights_error(sc: Scenario) -> str | None:
    """None, or why this model's weights leave no HBM for KV on this node, with changes that fit."""
    m, n, e = sc.model, sc.node, sc.engine
    budget = plan.kv_budget_bytes(m, n, e)
    if budget > 0:
        return None
    weights = plan.weight_bytes_per_gpu(m, n, e)
    usable = e.gpu_memory_utilization * n.hbm_bytes
    changes = [c for c in (_more_gpus(sc), _larger_gpu(sc), _more_memory(sc)) if c]
    fix = (f"Add {' or '.join(changes)} (each checked to leave HBM for KV)" if changes else
           "No --gpus, --gpu or --gpu-memory-utilization fixes it: lower --workspace-gib or --weight-gb")
    return (f"{m.name} does not fit on {n.gpus} x {gpu_named(n.hbm_bytes)}: weights take "
            f"{_gib(weights)} per GPU and the workspace {_gib(e.workspace_bytes)}, of "
            f"{_gib(usable)} usable ({e.gpu_memory_utilization} x {_gib(n.hbm_bytes)}), leaving "
            f"{_gib(budget)} for KV. {fix}")


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
