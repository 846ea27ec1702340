"""vLLM plugin entry point (group ``vllm.general_plugins``).

vLLM calls every general plugin once per process (API server, EngineCore, each worker), so registration must be
idempotent: the connector factory raises on a second registration of the same name.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_disagg.plugin")

CONNECTOR_NAME = "DisaggConnector"
CONNECTOR_MODULE = "vllm_disagg.connectors.disagg_connector"
# DisaggConnector over a KV tier (LMCache): MultiConnector with its order checked and tier KV events passed on.
TIERED_CONNECTOR_NAME = "DisaggTierConnector"
TIERED_CONNECTOR_MODULE = "vllm_disagg.connectors.tiered"


def log_like_vllm() -> None:
    """Send this package's log lines where vLLM sends its own, formatted alike. vLLM configures only its ``vllm``
    logger: without this, our INFO lines (start-up, transfer outcomes) are dropped and warnings come out as bare
    text without time, level or process. A ``vllm_disagg`` logger someone configured is left alone."""
    ours, theirs = logging.getLogger("vllm_disagg"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())


def register() -> None:
    """Register DisaggConnector and DisaggTierConnector with vLLM's KV connector factory (idempotent), and log
    like vLLM in this process."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM absent or too old: nothing to register into.
        logger.debug("vLLM's KVConnectorFactory not importable; DisaggConnector not registered")
        return
    log_like_vllm()
    for name, module in (
        (CONNECTOR_NAME, CONNECTOR_MODULE),
        (TIERED_CONNECTOR_NAME, TIERED_CONNECTOR_MODULE),
    ):
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, name)
