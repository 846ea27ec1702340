"""vLLM plugin entry point (group ``vllm.general_plugins``).

vLLM calls every general plugin once per process (API server, EngineCore, each worker), so registration must be
idempotent: the connector factory raises on a second registration of the same name.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_disagg.plugin")

CONNECTOR_NAME = "DisaggConnector"
CONNECTOR_MODULE = "vllm_disagg.connectors.disagg_connector"


def register() -> None:
    """Register DisaggConnector with vLLM's KV connector factory (no-op if already registered)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM absent or too old: nothing to register into.
        logger.debug("vLLM's KVConnectorFactory not importable; DisaggConnector not registered")
        return
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
