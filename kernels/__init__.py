"""Triton kernels for the engine (extend/prefill and decode attention over paged KV, KV store).

Installed as ``radix_kernels``: the bare name ``kernels`` is a different PyPI package that
transformers probes for. The kernels themselves arrive with the engine issue.
"""
