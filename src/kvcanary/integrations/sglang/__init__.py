"""SGLang as a canary host: kvcanary's canary on SGLang's own pool objects.

::

    from kvcanary.canary.config import CanaryConfig
    from kvcanary.integrations.sglang import SGLangForwardBatchView, install_on_sglang

    canary = install_on_sglang(model_runner.token_to_kv_pool, model_runner.req_to_token_pool,
                               CanaryConfig(mode="log", real_data="partial"),
                               sliding_window=model_runner.sliding_window_size)
    # per forward:
    view = SGLangForwardBatchView(forward_batch)
    canary.before_forward(view)      # before attention metadata is built
    ...                              # the model forward (SGLang's set_kv_buffer / set_*_key_buffer)
    canary.after_forward(view)
    canary.end_step()                # between scheduler steps

Supported: sglang 0.5.23's ``MHATokenToKVPool``, ``SWAKVPool`` and
``DeepSeekV4TokenToKVPool`` (every sub-pool: SWA, C4, C4 indexer, C128); see
:mod:`.pools` for the groups and what is refused, :mod:`.host` for the store check,
:mod:`.batch` for the forward-mode rules. Importing this package imports SGLang (and checks
its version).
"""

from kvcanary.integrations.sglang.batch import SGLangForwardBatchView, prefix_and_extend_lens
from kvcanary.integrations.sglang.host import SGLangHost, install_on_sglang
from kvcanary.integrations.sglang.pools import (
    SUPPORTED_POOLS,
    SUPPORTED_SGLANG_VERSIONS,
    check_sglang_version,
    check_supported_pool,
)

__all__ = [
    "SUPPORTED_POOLS",
    "SUPPORTED_SGLANG_VERSIONS",
    "SGLangForwardBatchView",
    "SGLangHost",
    "check_sglang_version",
    "check_supported_pool",
    "install_on_sglang",
    "prefix_and_extend_lens",
]
