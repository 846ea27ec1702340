"""Pool planner and P/D simulator: pure Python, no torch, no vLLM.

* ``plan``: KV bytes, transfer time, per-GPU prefill/decode rates, the balanced prefill share, instance counts.
* ``simulate``: discrete-event simulation of colocated vs disaggregated serving, replaying a router ``Policy``.
* ``profile``: measure a running vLLM server into a JSON profile that replaces the roofline rates.
"""

from __future__ import annotations

from vllm_disagg.planner.costmodel import BatchShape, ProfileCost, RooflineCost, StepModel
from vllm_disagg.planner.hardware import GPU, GPUS, LINKS, InstanceSpec, Link, gpu_preset, link_preset
from vllm_disagg.planner.model import ModelSpec, preset_model
from vllm_disagg.planner.plan import PoolPlan, make_plan, prefill_share
from vllm_disagg.planner.profiledata import Profile

__all__ = [
    "GPU",
    "GPUS",
    "LINKS",
    "BatchShape",
    "StepModel",
    "InstanceSpec",
    "Link",
    "ModelSpec",
    "PoolPlan",
    "Profile",
    "ProfileCost",
    "RooflineCost",
    "gpu_preset",
    "link_preset",
    "make_plan",
    "prefill_share",
    "preset_model",
]
