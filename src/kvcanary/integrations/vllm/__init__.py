"""The KV-cache canary on vLLM: a KV connector (``KVCanaryConnector``) that verifies the
records of every KV slot a forward reads and writes those of every slot it fills, through
vLLM's public connector hooks (docs/VLLM.md).

* :mod:`.connector` -- the vLLM connector (imports vLLM);
* :mod:`.worker` -- vLLM's KV cache groups and attention metadata as canary pools and
  batches (no vLLM import);
* :mod:`.options` -- ``kv_connector_extra_config`` -> canary options.

:func:`register` is the ``vllm.general_plugins`` entry point: it makes the name
``KVCanaryConnector`` known to vLLM's connector factory in every vLLM process.
"""

from __future__ import annotations

from kvcanary.integrations.vllm.options import CONNECTOR_MODULE, CONNECTOR_NAME

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "register"]


def register() -> None:
    """vLLM general plugin: register ``KVCanaryConnector`` with the connector factory
    (idempotent: vLLM loads plugins once per process, tests may call it again)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, "KVCanaryConnector")
