"""The vLLM KV connector (``vllm_disagg.connectors``). The only part of the project that imports vLLM and torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_disagg.connectors.disagg_connector import DisaggConnector

__all__ = ["DisaggConnector"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import vllm_disagg.connectors.plugin` (run in every vLLM process) stays cheap.
    if name == "DisaggConnector":
        from vllm_disagg.connectors.disagg_connector import DisaggConnector

        return DisaggConnector
    raise AttributeError(name)
