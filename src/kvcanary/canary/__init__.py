"""The KV-cache integrity canary (wire-compatible with SGLang's kv_canary).

Numeric core: :mod:`.constants` (record layout, tags, fail reasons), :mod:`.hashing`,
:mod:`.records`, :mod:`.real_kv`, :mod:`.plan` (what to verify/write per forward),
:mod:`.kernels` (verify/write), :mod:`.ring` and :mod:`.violation` (reports and log lines).
"""
