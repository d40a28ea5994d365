"""A KV connector that does nothing: ``kvcanary bench vllm``'s connector control, which
measures what vLLM's KV connector interface costs a step (its calls around the forward,
metadata and outputs; no per-layer calls, as a connector that needs none) with no canary
behind it, so the bench can tell that cost from the canary's.
Registered by the bench in its own engine process only (imports vLLM)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

NAME = "KVCanaryNoopConnector"


class NoopConnector(KVConnectorBase_V1, SupportsHMA):
    """Every hook returns at once; the scheduler side loads nothing and sends empty
    metadata (a hybrid model keeps vLLM's hybrid allocator, as with the canary's)."""

    def has_connector_metadata(self) -> bool:
        return False  # no per-layer calls (vLLM asks this before each layer's)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:  # fmt: skip
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:  # fmt: skip
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        return False, None


def register() -> None:
    """Make :data:`NAME` known to vLLM's connector factory in this process (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in getattr(KVConnectorFactory, "_registry", {}):
        KVConnectorFactory.register_connector(NAME, __name__, "NoopConnector")
