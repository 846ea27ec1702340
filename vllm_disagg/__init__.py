"""vllm-disagg: prefill/decode disaggregation for vLLM.

Three faces: a KV connector (``vllm_disagg.connectors``, loaded by vLLM through the ``vllm.general_plugins`` entry
point), a prefix-aware proxy (``vllm_disagg.router``) and a planner. This core package imports neither vLLM nor torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

from vllm_disagg.native import activate as _activate_native

_activate_native()  # before any compiled module is imported: a stale build must not shadow its sources
