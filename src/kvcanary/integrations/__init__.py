"""Hosts of the KV canary: each module wires the canary (:mod:`kvcanary.canary`, which knows
no host) into one inference engine through the contract of :mod:`kvcanary.canary.host`.

:mod:`.engine_host`: kvcanary's own engine (:mod:`kvcanary.engine`). Future siblings:
``vllm/`` (KV-connector hooks before / after the forward), ``sglang/`` (SGLang's pool
objects driven from an SGLang-shaped forward batch).

Nothing here is imported unless a canary is enabled.
"""
