"""The KV-cache integrity canary (wire-compatible with SGLang's kv_canary).

Numeric core: :mod:`.constants` (record layout, tags, fail reasons), :mod:`.hashing`,
:mod:`.records`, :mod:`.real_kv`, :mod:`.plan` / :mod:`.plan_numba` (what to verify/write
per forward), :mod:`.kernels` (verify/write), :mod:`.ring` and :mod:`.violation` (reports
and log lines).

Runtime: :mod:`.config` (CanaryConfig), :mod:`.buffers` (record buffer groups),
:mod:`.adapters` + :mod:`.splice` (per pool type), :mod:`.plan_inputs`,
:mod:`.single_forward` (HEAD/TAIL of one forward), :mod:`.pump` + :mod:`.reporter`
(violations to the host, modes), :mod:`.manager` (CanaryManager: the host's calls
``before_forward`` / ``after_forward`` / ``end_step``), :mod:`.install` (install_canary),
:mod:`.errors`. The host contract: :mod:`.host` (typed protocols) and
docs/CANARY_PROTOCOL.md; hosts live in :mod:`kvcanary.integrations`.

Observability: :mod:`.delayed` (one-step-late device reads), :mod:`.sweep` (radix sweep),
:mod:`.stats_logger`, :mod:`.health` (kernel-run-counter check), :mod:`.swa_divergence`
(SWA coverage telemetry), :mod:`.token_oracle` (write-input expectations). Self-test and
diagnosis: :mod:`.perturb` (fault injection), :mod:`.explain` (violation lines -> causes).
"""
