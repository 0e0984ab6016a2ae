"""vLLM's real CPU engine on a tiny local model: what the end-to-end tests, figures and demo run.

``model`` builds the model and tokenizer (no download), ``overlay`` selects
vLLM's CPU build (installed beside the 0.34 classes by ``scripts/bootstrap``)
for an engine subprocess, ``run`` is that subprocess. Imports neither vLLM
nor torch until an engine or a model build needs them.
"""
