"""Hosts of the KV canary: each module wires the canary (:mod:`kvcanary.canary`, which knows
no host) into one inference engine through the contract of :mod:`kvcanary.canary.host`.

:mod:`.native`: kvcanary's own engine (:mod:`kvcanary.engine`); :mod:`.sglang`:
SGLang 0.5.23's real pool objects, driven from SGLang's ``ForwardBatch``; ``vllm/``: a vLLM
KV connector (hooks before / after the forward).

Nothing here is imported unless a canary is enabled.
"""
