"""DisaggConnector: vLLM's KV-connector interface on top of the layer-wise transfer engine.

Per request, ``kv_transfer_params`` chooses the role (any instance can be P for one request and D for another):

* ``{"do_remote_decode": true, "transfer_id": T}`` -- this instance prefills (P). Each layer's completed blocks are
  offered to the transfer engine from ``save_kv_layer`` as the forward pass produces them, across chunked-prefill
  steps; at the end the blocks are held (``request_finished`` returns True) until decode has them or the lease ends.
  The response carries ``kv_transfer_params`` for decode, so vLLM's sequential example proxies work unchanged.
* ``{"do_remote_prefill": true, "transfer_id": T, "remote_host": H, "remote_port": P}`` -- this instance decodes
  (D). It allocates blocks for the prompt tokens its own prefix cache lacks, registers them with P, and waits
  (asynchronously, the request parked in WAITING_FOR_REMOTE_KVS) until every block of every layer arrived. Any
  failure reports the load failed, and vLLM recomputes the prompt locally (``kv_load_failure_policy: recompute``).

The scheduler side only plans (pure bookkeeping, in :class:`_SchedulerSide`); the worker side moves bytes.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from array import array
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_disagg.config import WILDCARD_HOSTS, ConnectorConfig
from vllm_disagg.connectors.device_store import DeviceBlockStore
from vllm_disagg.connectors.stats import DisaggPromMetrics, DisaggStats
from vllm_disagg.kv_layout import KVGeometry, StepChunk, kv_dtype_tag, num_blocks
from vllm_disagg.transfer_params import (
    LOAD_OUTCOME_KEY,
    PROOF_KEY,
    RemoteDecode,
    RemotePrefill,
    host_allowed,
    parse_transfer_params,
    prefill_proof,
)
from vllm_disagg.transport.block_store import HostBlockStore, staging_owner
from vllm_disagg.transport.channel import SideChannel
from vllm_disagg.transport.engine import EngineSettings, TransferEngine
from vllm_disagg.transport.faults import FaultInjector, FaultySideChannel

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_disagg.connector")


@dataclass
class SendChunk:
    """P: blocks of one request that became complete in this step, to offer layer by layer."""

    req_id: str
    transfer_id: str
    prompt_len: int
    blocks: list[tuple[int, int]]  # (logical index, local block id)
    first: bool
    last: bool
    prompt_hash: str = ""
    # someone holding the shared secret asked for this hold (or there is no secret); else prefill holds the KV only
    # briefly until a decode claims it (``unvouched_lease_s``)
    vouched: bool = True


@dataclass
class LoadSpec:
    """D: fetch ``transfer_id`` from ``host:port`` into ``dest_blocks`` (logical indices from ``first_block``).

    ``port`` is the prefill's base side-channel port; TP rank r dials ``port + r`` (prefill rank r listens there).
    """

    req_id: str
    transfer_id: str
    host: str
    port: int
    dest_blocks: list[int]
    first_block: int
    prompt_len: int
    prompt_hash: str = ""


@dataclass
class DisaggConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker. Tuples carry (transfer id, ...) and, where ids may be shared, the request."""

    sends: list[SendChunk] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # D: loads aborted while waiting (transfer id, req id)
    cancels: list[tuple[str, str]] = field(default_factory=list)
    # P: requests finished (transfer id, aborted, req id)
    finished_sends: list[tuple[str, bool, str]] = field(default_factory=list)
    # P: sends whose blocks vLLM freed by preemption (transfer id, req id)
    preempted_sends: list[tuple[str, str]] = field(default_factory=list)
    # D: requests that finished without loading (transfer id, host, port): prefill may free now
    declines: list[tuple[str, str, int]] = field(default_factory=list)
    # D: requests queued here that will load (transfer id, host, port): renew prefill's lease meanwhile
    watches: list[tuple[str, str, int]] = field(default_factory=list)
    # P: requests that were to send and ended before computing anything: tell a registered decode to recompute
    unstarted_sends: list[str] = field(default_factory=list)


@dataclass
class _Send:
    request: Request
    transfer_id: str
    vouched: bool = True
    block_ids: list[int] = field(default_factory=list)
    started: bool = False
    # vLLM freed the blocks mid-send: nothing is offered until the request resumes on new blocks, and then its first
    # step offers every complete block again (the sender skips those already sent)
    preempted: bool = False
    resumed: bool = False


@dataclass
class _Role:
    """What a request's kv_transfer_params ask of this instance, parsed once."""

    role: RemoteDecode | RemotePrefill | None
    duplicate: bool = False  # another live request holds the same transfer id here: served locally


def prompt_hash(request: Request) -> str:
    """A short hash of the prompt's token ids: decode and prefill compare it before any block moves."""
    ids = request.prompt_token_ids
    if ids is None:
        return ""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=8).hexdigest()


class _SchedulerSide:
    def __init__(
        self, cfg: ConnectorConfig, engine_id: str, block_size: int, tp_size: int, port_offset: int = 0
    ) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.port = cfg.side_channel_port + port_offset  # this engine's rank-0 port (advertised to decode)
        self.roles: dict[str, _Role] = {}
        self.tids: dict[str, str] = {}  # transfer id -> the live request that owns it here
        self.sends: dict[str, _Send] = {}
        self.planned: set[str] = set()  # requests whose remote load was planned (never plan twice)
        self.loading: dict[str, str] = {}  # req id -> transfer id, while waiting for remote KV
        # D: requests whose load failed (vLLM recomputes their prompt here): their answer says so (request_finished)
        self.load_failed: set[str] = set()
        self.pending_loads: list[LoadSpec] = []
        self.pending_cancels: list[tuple[str, str]] = []
        self.pending_finished: list[tuple[str, bool, str]] = []
        self.pending_declines: list[tuple[str, str, int]] = []
        self.pending_watches: list[tuple[str, str, int]] = []
        self.pending_unstarted: list[str] = []
        self.rejected = 0  # requests whose kv_transfer_params were refused (served locally)
        self.secret = cfg.secret()
        # Requests whose blocks vLLM keeps for a transfer (request_finished said so) until a worker reports them done,
        # each with when that must have happened (the engine frees held blocks at the lease's end at the latest).
        self.held: dict[str, float] = {}
        self.hold_s = max(cfg.lease_s, cfg.load_timeout_s) + 5.0

    def role(self, request: Request) -> _Role:
        """Parse and remember the request's role; a bad field is logged once and the request served locally."""
        req_id = request.request_id
        known = self.roles.get(req_id)
        if known is not None:
            return known
        parsed: RemoteDecode | RemotePrefill | None = None
        try:
            parsed = parse_transfer_params(request.kv_transfer_params)
        except Exception as exc:  # TransferParamsError, or a parser bug: never raise inside vLLM's scheduler
            self._refuse(req_id, f"ignoring kv_transfer_params ({exc})")
        if isinstance(parsed, RemoteDecode) and self.cfg.decode_only:
            self._refuse(req_id, "do_remote_decode on a decode_only instance (no send hooks)")
            parsed = None
        if isinstance(parsed, RemoteDecode) and not parsed.transfer_id:
            parsed = RemoteDecode(transfer_id=f"{self.engine_id}:{req_id}")
        if isinstance(parsed, RemotePrefill) and not host_allowed(
            parsed.host, self.cfg.allowed_prefill_hosts
        ):
            self._refuse(req_id, f"remote_host {parsed.host} is not in allowed_prefill_hosts")
            parsed = None
        if isinstance(parsed, RemotePrefill) and not parsed.vouched(self.secret):
            self._refuse(
                req_id,
                f"the prefill {parsed.host}:{parsed.port} is not vouched for (no valid {PROOF_KEY}): with a "
                "shared_secret this instance dials only prefills named by the proxy or by a prefill instance that "
                "holds the secret; give the proxy the same secret",
            )
            parsed = None
        role = _Role(parsed)
        if parsed is not None:
            owner = self.tids.get(parsed.transfer_id)
            if owner is not None and owner != req_id:
                # n > 1 children and resends share one id: only the first moves KV, the others run locally.
                logger.info(
                    "request %s: transfer id %s is in use by request %s here; serving it locally",
                    req_id,
                    parsed.transfer_id,
                    owner,
                )
                role.duplicate = True
            else:
                self.tids[parsed.transfer_id] = req_id
                if isinstance(parsed, RemotePrefill):
                    self.pending_watches.append((parsed.transfer_id, parsed.host, parsed.port))
        self.roles[req_id] = role
        return role

    def _refuse(self, req_id: str, why: str) -> None:
        """Count and log a request whose kv_transfer_params are not acted on; it is served locally."""
        self.rejected += 1
        logger.warning("request %s: %s; serving it locally without a KV transfer", req_id, why)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        r = self.role(request)
        if r.duplicate or r.role is None:
            return 0, False
        if isinstance(r.role, RemoteDecode):
            if request.request_id not in self.sends:
                vouched = r.role.vouched(self.secret)
                self.sends[request.request_id] = _Send(request, r.role.transfer_id, vouched=vouched)
            return 0, False
        if request.request_id in self.planned:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        r = self.roles.get(request.request_id)
        if (
            num_external_tokens <= 0
            or r is None
            or r.duplicate
            or not isinstance(r.role, RemotePrefill)
            or request.request_id in self.planned
        ):
            return
        self.planned.add(request.request_id)
        block_ids = list(blocks.get_block_ids()[0])
        total = num_blocks(request.num_prompt_tokens, self.block_size)
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        self.loading[request.request_id] = r.role.transfer_id
        self.pending_loads.append(
            LoadSpec(
                req_id=request.request_id,
                transfer_id=r.role.transfer_id,
                host=r.role.host,
                port=r.role.port,
                dest_blocks=block_ids[first:total],
                first_block=first,
                prompt_len=request.num_prompt_tokens,
                prompt_hash=prompt_hash(request),
            )
        )

    def build_connector_meta(self, so: SchedulerOutput) -> DisaggConnectorMetadata:
        meta = DisaggConnectorMetadata(
            loads=self.pending_loads,
            cancels=self.pending_cancels,
            finished_sends=self.pending_finished,
            declines=self.pending_declines,
            watches=self.pending_watches,
            unstarted_sends=self.pending_unstarted,
        )
        self.pending_loads, self.pending_cancels, self.pending_finished = [], [], []
        self.pending_declines, self.pending_watches, self.pending_unstarted = [], [], []
        for req_id in so.preempted_req_ids or ():
            send = self.sends.get(req_id)
            if send is not None and send.started and not send.preempted:
                # vLLM freed the blocks: the worker stops reading them before the forward pass reuses them.
                send.preempted = True
                meta.preempted_sends.append((send.transfer_id, req_id))
        for new in so.scheduled_new_reqs:
            send = self.sends.get(new.req_id)
            if send is not None:
                send.block_ids = list(new.block_ids[0])
                send.resumed, send.preempted = send.preempted, False
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            send = self.sends.get(req_id)
            if send is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                send.block_ids = list(new_ids[0]) if new_ids else []
                send.resumed, send.preempted = send.preempted, False
            elif new_ids:
                send.block_ids.extend(new_ids[0])
        for req_id, send in self.sends.items():
            n = so.num_scheduled_tokens.get(req_id, 0)
            if n <= 0 or send.preempted:
                continue
            req = send.request
            chunk = StepChunk(
                start=req.num_computed_tokens,
                end=req.num_computed_tokens + n,
                prompt_len=req.num_prompt_tokens,
                block_size=self.block_size,
                first_step=not send.started or send.resumed,
            )
            idx = chunk.sendable_blocks()
            meta.sends.append(
                SendChunk(
                    req_id=req_id,
                    transfer_id=send.transfer_id,
                    prompt_len=req.num_prompt_tokens,
                    blocks=[(i, send.block_ids[i]) for i in idx if i < len(send.block_ids)],
                    first=not send.started,
                    last=chunk.end >= req.num_prompt_tokens,
                    prompt_hash=prompt_hash(req) if not send.started else "",
                    vouched=send.vouched,
                )
            )
            send.started, send.resumed = True, False
        return meta

    def update_connector_output(
        self,
        finished_recving: AbstractSet[str],
        finished_sending: AbstractSet[str] = frozenset(),
        failed_recving: AbstractSet[str] = frozenset(),
    ) -> None:
        for req_id in finished_recving:
            self.loading.pop(req_id, None)
            self.held.pop(req_id, None)
        for req_id in failed_recving:
            if req_id in self.roles:
                self.load_failed.add(req_id)
        for req_id in finished_sending:
            self.held.pop(req_id, None)

    def has_pending_block_frees(self, now: float) -> bool:
        """Whether blocks held for transfers will come back soon: vLLM then waits for them instead of preempting a
        running request (whose prefill would be computed again). A hold past its deadline no longer counts (its
        report was lost: waiting on it could stall the scheduler for good)."""
        for req_id, deadline in list(self.held.items()):
            if deadline > now:
                return True
            del self.held[req_id]
        return False

    def _hold(self, req_id: str) -> None:
        self.held[req_id] = time.monotonic() + self.hold_s

    def request_finished(self, request: Request, host: str) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        role = self.roles.pop(req_id, None)
        if role is not None and role.role is not None and self.tids.get(role.role.transfer_id) == req_id:
            del self.tids[role.role.transfer_id]
        was_planned = req_id in self.planned
        self.planned.discard(req_id)
        load_failed = req_id in self.load_failed
        self.load_failed.discard(req_id)
        tid = self.loading.pop(req_id, None)
        if tid is not None:
            # Aborted while waiting for KV: keep the blocks until the worker confirms no more writes land in them.
            self.pending_cancels.append((tid, req_id))
            self._hold(req_id)
            return True, None
        if (
            role is not None
            and isinstance(role.role, RemotePrefill)
            and not role.duplicate
            and not was_planned
        ):
            # Finished without loading (aborted while queued, prompt logprobs, a local hit): prefill may free now.
            self.pending_declines.append((role.role.transfer_id, role.role.host, role.role.port))
        send = self.sends.pop(req_id, None)
        if send is None:
            if role is not None and isinstance(role.role, RemoteDecode) and not role.duplicate:
                # aborted while queued, before the scheduler ever considered it: a decode may have registered
                self.pending_unstarted.append(role.role.transfer_id)
            if load_failed:
                # The answer (a whole one: vLLM puts these params in non-streamed responses) tells the proxy that
                # this prompt was computed here, not moved: its header, metrics and policy then say so.
                return False, {LOAD_OUTCOME_KEY: "failed"}
            return False, None
        if not send.started:
            self.pending_unstarted.append(send.transfer_id)  # decode may have registered: it recomputes now
            return False, None
        complete = request.num_computed_tokens >= request.num_prompt_tokens
        aborted = send.preempted or not complete or request.status.name == "FINISHED_ABORTED"
        self.pending_finished.append((send.transfer_id, aborted, req_id))
        self._hold(req_id)
        if aborted:
            return True, None
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": send.transfer_id,
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": self.port,
            PROOF_KEY: prefill_proof(self.secret, send.transfer_id, host, self.port),
            "remote_request_id": req_id,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_block_ids": [],
            "tp_size": self.tp_size,
        }


def _layer_order(name: str) -> tuple[tuple[int, int | str], ...]:
    """Natural sort key of a KV cache (attention layer) name: ``model.layers.10`` after ``model.layers.9``, and
    ``transformer.h.N`` (GPT-2, Falcon, Bloom) or ``transformer.blocks.N`` (MPT, DBRX) the same way."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in name.split("."))


def _cpu_kv_layout_tag(dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str) -> str:
    """Which CPU kernels wrote the block bytes: blocks move verbatim, so both sides must agree on it (device caches
    get their layout tag from connectors/device_store.py). vLLM's CPU attention picks its kernels per host: on an
    AMX host a bf16 model's cache is packed for AMX tiles, elsewhere the same shape holds the vector kernels'
    layout, and torch's capability string ("AVX512") does not tell the two apart. So the tag names the kernels
    vLLM chose (``cpu_attn._get_attn_isa``, as its attention backend calls it) beside the capability."""
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
    except (ImportError, NotImplementedError, AttributeError, TypeError):
        # a vLLM without this helper: the host's AMX support stands in for it (AMX packs only bf16)
        amx = dtype == torch.bfloat16 and bool(torch.cpu._is_amx_tile_supported())
        isa = "amx?" if amx else "?"
    return f"cpu:{capability}:{isa}"


class _WorkerSide:
    def __init__(
        self, cfg: ConnectorConfig, vllm_config: VllmConfig, engine_id: str, port_offset: int
    ) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.port_offset = (
            port_offset  # data-parallel rank x TP size: every worker of the node has its own port
        )
        self.tp_rank = 0
        self.engine: TransferEngine | None = None
        self._refusals_reported = 0.0  # the engine's handshakes_refused count as last reported in stats()
        self.store: Any = None
        self.layer_of: dict[str, int] = {}
        self.meta: DisaggConnectorMetadata | None = None
        # Tests (the fault matrix) name a rules file: wrap the engine's side channel and the per-step hook.
        faults = FaultInjector.from_env()
        self._wrap_channel: Callable[[SideChannel], SideChannel] | None = None
        if faults is not None:
            self._wrap_channel = FaultySideChannel.wrapper(faults)
            self.bind = faults.slow_steps(self.bind)  # type: ignore[method-assign]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        names = sorted(kv_caches, key=_layer_order)
        self.layer_of = {n: i for i, n in enumerate(names)}
        tensors = [kv_caches[n] for n in names]
        first = tensors[0]
        if first.device.type != "cpu":
            self._register_device_caches(tensors)
            return
        for t in tensors:
            if not t.is_contiguous() or t.shape != first.shape:
                raise ValueError(
                    f"unexpected KV cache layout {tuple(t.shape)}; expected equal contiguous layers"
                )
        num_gpu_blocks = self.vllm_config.cache_config.num_gpu_blocks or first.shape[0]
        if first.shape[0] != num_gpu_blocks:
            raise ValueError(
                f"KV cache tensor {tuple(first.shape)} is not block-major (first dim {first.shape[0]} != "
                f"{num_gpu_blocks} blocks); this layout is not supported"
            )
        layers = [t.view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in tensors]
        store = HostBlockStore(layers)
        block_size = self.vllm_config.cache_config.block_size
        cache_dtype = str(self.vllm_config.cache_config.cache_dtype)  # fp8 variants are all uint8 tensors
        resolved = self.vllm_config.model_config.dtype  # a torch.dtype once vLLM resolved "auto"
        model_dtype = resolved if isinstance(resolved, torch.dtype) else first.dtype
        # CPU layout: [num_blocks, num_kv_heads, block_size, 2 * head_size]
        geometry = KVGeometry(
            model=str(self.vllm_config.model_config.model),
            num_layers=len(tensors),
            num_kv_heads=int(first.shape[1]),
            head_size=int(first.shape[-1]) // 2,
            block_size=block_size,
            dtype=kv_dtype_tag(str(first.dtype).removeprefix("torch."), cache_dtype),
            kv_layout=_cpu_kv_layout_tag(model_dtype, block_size, int(first.shape[-1]) // 2, cache_dtype),
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
            block_bytes=store.block_bytes,
        )
        self._start_engine(store, geometry)

    def _engine_settings(self, tp_rank: int) -> EngineSettings:
        return EngineSettings.from_config(self.cfg, self.cfg.side_channel_port + self.port_offset + tp_rank)

    def _register_device_caches(self, tensors: list[torch.Tensor]) -> None:
        """CUDA: indexed copies through vLLM's real strides for TCP, direct page access for NIXL (device_store)."""
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        from vllm_disagg.connectors.device_store import TorchDeviceOps, check_block_major
        from vllm_disagg.transport.nixl import nixl_available

        first = tensors[0]
        check_block_major(tuple(first.shape), int(self.vllm_config.cache_config.num_gpu_blocks or 0))
        store = DeviceBlockStore(
            tensors,
            TorchDeviceOps(first.device),
            direct=self.cfg.transport != "tcp" and nixl_available(),
            staging_budget_bytes=self.cfg.staging_budget_mb << 20,
        )
        if self.cfg.transport == "nixl" and not store.direct:
            raise ValueError(
                "transport: nixl needs each KV block to be one dense page, but this cache's layout stores heads "
                "outermost; unset VLLM_KV_CACHE_LAYOUT (or choose LBNHC/LBHNC) or use transport: tcp/auto"
            )
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        geometry = KVGeometry(
            model=str(mc.model),
            num_layers=len(tensors),
            num_kv_heads=int(mc.get_num_kv_heads(pc)),
            head_size=int(mc.get_head_size()),
            block_size=self.vllm_config.cache_config.block_size,
            dtype=kv_dtype_tag(
                str(first.dtype).removeprefix("torch."), str(self.vllm_config.cache_config.cache_dtype)
            ),
            kv_layout=store.layout_tag(),
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
            block_bytes=store.block_bytes,
        )
        self._start_engine(store, geometry)
        if store.direct and self.engine is not None and self.engine.data_path != "nixl":
            store.direct = False  # NIXL did not come up: stage through pinned host memory for TCP

    def _start_engine(self, store: Any, geometry: KVGeometry) -> None:
        self.store = store
        self.tp_rank = geometry.tp_rank
        self.engine = TransferEngine(
            store,
            geometry,
            self.engine_id,
            self._engine_settings(geometry.tp_rank),
            wrap_channel=self._wrap_channel,
        )
        logger.info(
            "DisaggConnector worker ready: %s, %d blocks of %d bytes",
            geometry,
            store.num_blocks,
            store.block_bytes,
        )

    def bind(self, meta: DisaggConnectorMetadata) -> None:
        self.meta = meta
        eng = self.engine
        if eng is None:
            return
        for tid, req_id in meta.cancels:
            eng.cancel_load(tid, req_id)
        for tid, host, port in meta.watches:
            eng.watch_load(tid, (host, port + self.tp_rank))
        for load in meta.loads:
            eng.start_load(
                load.req_id,
                load.transfer_id,
                (load.host, load.port + self.tp_rank),  # prefill's TP rank r listens on its base port + r
                load.dest_blocks,
                load.first_block,
                load.prompt_len,
                load.prompt_hash,
            )
        for tid, host, port in meta.declines:
            eng.decline_load(tid, (host, port + self.tp_rank))
        for send in meta.sends:
            if send.first:
                eng.begin_send(
                    send.transfer_id, send.req_id, send.prompt_len, send.prompt_hash, vouched=send.vouched
                )
        for tid, aborted, req_id in meta.finished_sends:
            eng.finish_send(tid, aborted, req_id)
        for tid in meta.unstarted_sends:
            eng.abort_unstarted_send(tid)

    def handle_preemptions(self, meta: DisaggConnectorMetadata) -> None:
        """Before the forward pass reuses a preempted prefill's freed blocks: drop their unsent offers and wait
        until nothing reads those blocks any more. The transfer goes on once the request resumes."""
        if self.engine is None:
            return
        if meta.preempted_sends:
            self.engine.suspend_sends(list(meta.preempted_sends))

    def save_kv_layer(self, layer_name: str) -> None:
        if self.engine is None or self.meta is None or not self.meta.sends:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        staged = self.store.staging == "device"
        for send in self.meta.sends:
            if send.blocks:
                if staged:  # device caches: queue the copy after this layer's kernels
                    self.store.stage(
                        staging_owner(send.transfer_id, send.req_id), layer, [b for _, b in send.blocks]
                    )
                self.engine.offer_blocks(send.transfer_id, layer, send.blocks, send.req_id)

    def wait_for_save(self) -> None:
        if self.engine is not None and self.meta is not None and self.meta.sends:
            self.engine.mark_forward_end([s.transfer_id for s in self.meta.sends if s.last])

    def results(self) -> KVConnectorTransferResults:
        if self.engine is None:
            return KVConnectorTransferResults()
        r = self.engine.poll_results()
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
        )

    def stats(self) -> DisaggStats | None:
        if self.engine is None:
            return None
        records = self.engine.drain_records()
        refused = self.engine.stats["handshakes_refused"]
        new_refusals, self._refusals_reported = refused - self._refusals_reported, refused
        if not records and not new_refusals:
            return None
        st = DisaggStats()
        for rec in records:
            st.record(rec)
        st.data["handshakes_refused"] += int(new_refusals)
        return st

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _check_topology(vllm_config: VllmConfig, kv_cache_config: Any) -> int:
    """Refuse what this connector cannot pair correctly, naming the setting; return the worker port offset.

    Every worker of a node listens on ``side_channel_port + offset + tp_rank``, offset = data-parallel rank x TP
    size, so DP engines on one host never collide and each advertises its own base port.
    """
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise ValueError(
            f"DisaggConnector does not support pipeline parallelism (--pipeline-parallel-size "
            f"{pc.pipeline_parallel_size}): stages would pair with the wrong layers. Use "
            "--tensor-parallel-size instead, or a connector that supports PP."
        )
    for name, flag in (
        ("decode_context_parallel_size", "--decode-context-parallel-size"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
    ):
        size = int(getattr(pc, name, 1) or 1)
        if size > 1:
            # vLLM's block ids then cover block_size x size tokens interleaved over ranks, which this connector's
            # block ranges (and the peer's geometry check) do not describe: blocks would be offered before their
            # tokens are computed
            raise ValueError(
                f"DisaggConnector does not support context parallelism ({flag} {size}): its blocks span ranks, and "
                "prefill would send KV before it is computed. Run without it, or use vLLM's NixlConnector."
            )
    if getattr(vllm_config.model_config, "use_mla", False):
        raise ValueError(
            "DisaggConnector does not support MLA models (DeepSeek-V2/V3 family): every TP rank would ship the same "
            "latent cache. Use vLLM's NixlConnector for MLA."
        )
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ValueError(
            f"DisaggConnector moves one KV cache group, but this model has {len(groups)} (hybrid attention: sliding "
            "window, Mamba or cross-attention layers). Run it with --disable-hybrid-kv-cache-manager if vLLM allows, "
            "or use a connector that supports the hybrid allocator."
        )
    dp_index = int(getattr(pc, "data_parallel_index", 0) or 0)
    return dp_index * pc.tensor_parallel_size


class DisaggConnector(KVConnectorBase_V1):
    """Layer-wise P/D KV transfer. Configure with ``kv_connector_extra_config`` (see :class:`ConnectorConfig`)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        self.engine_id = str(ktc.engine_id or uuid.uuid4())
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        port_offset = _check_topology(vllm_config, kv_cache_config)
        if self.cfg.decode_only and getattr(ktc, "kv_role", "") != "kv_consumer":
            raise ValueError(
                f"decode_only is set but kv_role is {getattr(ktc, 'kv_role', None)!r}: an instance that may prefill for "
                'a transfer needs its per-layer hooks; use "kv_role": "kv_consumer" or drop decode_only'
            )
        if role == KVConnectorRole.SCHEDULER:
            if getattr(ktc, "kv_role", "") == "kv_consumer" and not self.cfg.decode_only:
                logger.info(
                    'kv_role is kv_consumer: add "decode_only": true to kv_connector_extra_config to keep FULL CUDA '
                    "graphs on this decode instance"
                )
            if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
                logger.warning(
                    "kv_load_failure_policy is %r: a failed KV load will fail the request instead of recomputing it. "
                    'Set "kv_load_failure_policy": "recompute" in --kv-transfer-config to never lose a request.',
                    ktc.kv_load_failure_policy,
                )
            # read once: the primary address does not change under a running instance (and finding it opens a socket)
            self._advertised = self.cfg.advertised_host()
            wildcard = self.cfg.side_channel_host in WILDCARD_HOSTS
            if self._advertised.startswith("127.") and not self.cfg.advertise_host and wildcard:
                logger.warning(
                    "DisaggConnector advertises %s to decode instances: this host has no outward route, so a decode "
                    "on another host cannot reach this instance's side channel. Set advertise_host in "
                    "kv_connector_extra_config to an address decode instances can dial.",
                    self._advertised,
                )
            self._sched = _SchedulerSide(
                self.cfg,
                self.engine_id,
                vllm_config.cache_config.block_size,
                vllm_config.parallel_config.tensor_parallel_size,
                port_offset,
            )
        else:
            self._worker = _WorkerSide(self.cfg, vllm_config, self.engine_id, port_offset)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Prefilling for a transfer offers each layer from save_kv_layer, which FULL graphs would skip; a
        decode-only instance loads asynchronously and keeps FULL graphs."""
        return not bool((extra_config or {}).get("decode_only", False))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return DisaggStats(data=data) if data is not None else DisaggStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return DisaggPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.stats() if self._worker is not None else None

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(
            set(connector_output.finished_recving or ()),
            set(connector_output.finished_sending or ()),
            set(getattr(connector_output, "failed_recving", None) or ()),
        )

    def has_pending_block_frees(self) -> bool:
        return self._sched is not None and self._sched.has_pending_block_frees(time.monotonic())

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.role(request)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, self._advertised)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, DisaggConnectorMetadata)
            self._worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, DisaggConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # loads are asynchronous and started from bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # a request is scheduled only after all of its layers arrived

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The pre-0.32 API cannot say a load failed; vLLM 0.32 calls get_transfer_results instead."""
        r = self.get_transfer_results(finished_req_ids)
        if r.failed_recving:
            logger.error(
                "get_finished cannot report failed loads (%s); a caller of this old API would use unwritten KV. "
                "Use get_transfer_results.",
                sorted(r.failed_recving),
            )
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.results()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
