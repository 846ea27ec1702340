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

import logging
import re
import uuid
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

from vllm_disagg.config import ConnectorConfig
from vllm_disagg.connectors.stats import DisaggPromMetrics, DisaggStats
from vllm_disagg.kv_layout import KVGeometry, StepChunk, num_blocks
from vllm_disagg.transport.block_store import HostBlockStore
from vllm_disagg.transport.engine import EngineSettings, TransferEngine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_disagg.connector")

_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class SendChunk:
    """P: blocks of one request that became complete in this step, to offer layer by layer."""

    req_id: str
    transfer_id: str
    prompt_len: int
    blocks: list[tuple[int, int]]  # (logical index, local block id)
    first: bool
    last: bool


@dataclass
class LoadSpec:
    """D: fetch ``transfer_id`` from ``host:port`` into ``dest_blocks`` (logical indices from ``first_block``)."""

    req_id: str
    transfer_id: str
    host: str
    port: int
    dest_blocks: list[int]
    first_block: int
    prompt_len: int


@dataclass
class DisaggConnectorMetadata(KVConnectorMetadata):
    sends: list[SendChunk] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # transfer ids of loads aborted on decode
    finished_sends: list[tuple[str, bool]] = field(default_factory=list)  # (transfer id, aborted)


@dataclass
class _Send:
    request: Request
    transfer_id: str
    block_ids: list[int] = field(default_factory=list)
    started: bool = False


class _SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, block_size: int, tp_size: int) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.sends: dict[str, _Send] = {}
        self.planned: set[str] = set()  # requests whose remote load was planned (never plan twice)
        self.loading: dict[str, str] = {}  # req id -> transfer id, while waiting for remote KV
        self.pending_loads: list[LoadSpec] = []
        self.pending_cancels: list[str] = []
        self.pending_finished: list[tuple[str, bool]] = []

    @staticmethod
    def _params(request: Request) -> dict[str, Any]:
        return request.kv_transfer_params or {}

    def transfer_id(self, request: Request) -> str:
        tid = self._params(request).get("transfer_id")
        return str(tid) if tid else f"{self.engine_id}:{request.request_id}"

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._params(request)
        if params.get("do_remote_decode") and request.request_id not in self.sends:
            self.sends[request.request_id] = _Send(request=request, transfer_id=self.transfer_id(request))
        if not params.get("do_remote_prefill") or request.request_id in self.planned:
            return 0, False
        if not params.get("remote_host") or not params.get("remote_port"):
            logger.warning(
                "request %s: do_remote_prefill without remote_host/remote_port; prefilling locally",
                request.request_id,
            )
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = self._params(request)
        if (
            num_external_tokens <= 0
            or not params.get("do_remote_prefill")
            or request.request_id in self.planned
        ):
            return
        self.planned.add(request.request_id)
        block_ids = list(blocks.get_block_ids()[0])
        total = num_blocks(request.num_prompt_tokens, self.block_size)
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        tid = self.transfer_id(request)
        self.loading[request.request_id] = tid
        self.pending_loads.append(
            LoadSpec(
                req_id=request.request_id,
                transfer_id=tid,
                host=str(params["remote_host"]),
                port=int(params["remote_port"]),
                dest_blocks=block_ids[first:total],
                first_block=first,
                prompt_len=request.num_prompt_tokens,
            )
        )

    def build_connector_meta(self, so: SchedulerOutput) -> DisaggConnectorMetadata:
        meta = DisaggConnectorMetadata(
            loads=self.pending_loads, cancels=self.pending_cancels, finished_sends=self.pending_finished
        )
        self.pending_loads, self.pending_cancels, self.pending_finished = [], [], []
        for new in so.scheduled_new_reqs:
            if new.req_id in self.sends:
                self.sends[new.req_id].block_ids = list(new.block_ids[0])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            send = self.sends.get(req_id)
            if send is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                send.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                send.block_ids.extend(new_ids[0])
        for req_id, send in self.sends.items():
            n = so.num_scheduled_tokens.get(req_id, 0)
            if n <= 0:
                continue
            req = send.request
            chunk = StepChunk(
                start=req.num_computed_tokens,
                end=req.num_computed_tokens + n,
                prompt_len=req.num_prompt_tokens,
                block_size=self.block_size,
                first_step=not send.started,
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
                )
            )
            send.started = True
        return meta

    def update_connector_output(self, finished_recving: set[str]) -> None:
        for req_id in finished_recving:
            self.loading.pop(req_id, None)

    def request_finished(self, request: Request, host: str, port: int) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self.planned.discard(req_id)
        tid = self.loading.pop(req_id, None)
        if tid is not None:
            # Aborted while waiting for KV: keep the blocks until the worker confirms no more writes land in them.
            self.pending_cancels.append(tid)
            return True, None
        send = self.sends.pop(req_id, None)
        if send is None or not send.started:
            return False, None
        complete = request.num_computed_tokens >= request.num_prompt_tokens
        aborted = not complete or request.status.name == "FINISHED_ABORTED"
        self.pending_finished.append((send.transfer_id, aborted))
        if aborted:
            return True, None
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": send.transfer_id,
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": req_id,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_block_ids": [],
            "tp_size": self.tp_size,
        }


def _layer_index(name: str) -> int:
    m = _LAYER_RE.search(name)
    if m is None:
        raise ValueError(f"cannot find a layer index in KV cache name {name!r}")
    return int(m.group(1))


def _cpu_kv_layout_tag() -> str:
    """Which CPU kernel family wrote the block bytes: blocks move verbatim, so both sides must agree on it (device
    caches get their layout tag from connectors/device_store.py)."""
    return f"cpu:{torch.backends.cpu.get_cpu_capability()}"


class _WorkerSide:
    def __init__(self, cfg: ConnectorConfig, vllm_config: VllmConfig, engine_id: str) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.engine: TransferEngine | None = None
        self.store: Any = None
        self.layer_of: dict[str, int] = {}
        self.meta: DisaggConnectorMetadata | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        names = sorted(kv_caches, key=_layer_index)
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
        # CPU layout: [num_blocks, num_kv_heads, block_size, 2 * head_size]
        geometry = KVGeometry(
            model=str(self.vllm_config.model_config.model),
            num_layers=len(tensors),
            num_kv_heads=int(first.shape[1]),
            head_size=int(first.shape[-1]) // 2,
            block_size=block_size,
            dtype=str(first.dtype).removeprefix("torch."),
            kv_layout=_cpu_kv_layout_tag(),
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
            block_bytes=store.block_bytes,
        )
        self._start_engine(store, geometry)

    def _engine_settings(self, tp_rank: int) -> EngineSettings:
        return EngineSettings(
            bind_host=self.cfg.side_channel_host,
            port=self.cfg.side_channel_port + tp_rank,
            secret=self.cfg.secret(),
            lease_s=self.cfg.lease_s,
            load_timeout_s=self.cfg.load_timeout_s,
            heartbeat_s=self.cfg.heartbeat_s,
            connect_timeout_s=self.cfg.connect_timeout_s,
            trace_path=self.cfg.trace_path,
            transport=self.cfg.transport,
            verify_checksums=self.cfg.verify_checksums,
        )

    def _register_device_caches(self, tensors: list[torch.Tensor]) -> None:
        """CUDA (untested on GPU in this repo's CI): pinned staging for TCP, direct device memory for NIXL."""
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        from vllm_disagg.connectors.device_store import DeviceBlockStore, TorchCudaOps, detect_layout
        from vllm_disagg.transport.nixl import nixl_available

        first = tensors[0]
        num_blocks = int(self.vllm_config.cache_config.num_gpu_blocks or 0)
        kv_split = detect_layout(tuple(first.shape), num_blocks)
        seg = first[0, 0] if kv_split else first[0]
        store = DeviceBlockStore(
            tensors,
            TorchCudaOps(first.device),
            kv_split=kv_split,
            segment_bytes=seg.numel() * seg.element_size(),
            direct=not kv_split and self.cfg.transport != "tcp" and nixl_available(),
        )
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        geometry = KVGeometry(
            model=str(mc.model),
            num_layers=len(tensors),
            num_kv_heads=int(mc.get_num_kv_heads(pc)),
            head_size=int(mc.get_head_size()),
            block_size=self.vllm_config.cache_config.block_size,
            dtype=str(first.dtype).removeprefix("torch."),
            kv_layout=f"cuda:{'kvsplit' if kv_split else 'blockmajor'}:{tuple(first.shape[2 if kv_split else 1 :])}",
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
            block_bytes=store.block_bytes,
        )
        self._start_engine(store, geometry)
        if store.direct and self.engine is not None and self.engine.data_path != "nixl":
            store.direct = False  # NIXL did not come up: stage through pinned host memory for TCP

    def _start_engine(self, store: Any, geometry: KVGeometry) -> None:
        self.store = store
        self.engine = TransferEngine(store, geometry, self.engine_id, self._engine_settings(geometry.tp_rank))
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
        for tid in meta.cancels:
            eng.cancel_load(tid)
        for load in meta.loads:
            eng.start_load(
                load.req_id,
                load.transfer_id,
                (load.host, load.port),
                load.dest_blocks,
                load.first_block,
                load.prompt_len,
            )
        for send in meta.sends:
            if send.first:
                eng.begin_send(send.transfer_id, send.req_id, send.prompt_len)
        for tid, aborted in meta.finished_sends:
            eng.finish_send(tid, aborted)

    def save_kv_layer(self, layer_name: str) -> None:
        if self.engine is None or self.meta is None or not self.meta.sends:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        stage = getattr(self.store, "stage", None)  # device caches: queue the copy after this layer's kernels
        for send in self.meta.sends:
            if send.blocks:
                if stage is not None:
                    stage(layer, [block_id for _, block_id in send.blocks])
                self.engine.offer_blocks(send.transfer_id, layer, send.blocks)

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
        if not records:
            return None
        st = DisaggStats()
        for rec in records:
            st.record(rec)
        return st

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


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
        if role == KVConnectorRole.SCHEDULER:
            if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
                logger.warning(
                    "kv_load_failure_policy is %r: a failed KV load will fail the request instead of recomputing it. "
                    'Set "kv_load_failure_policy": "recompute" in --kv-transfer-config to never lose a request.',
                    ktc.kv_load_failure_policy,
                )
            self._sched = _SchedulerSide(
                self.cfg,
                self.engine_id,
                vllm_config.cache_config.block_size,
                vllm_config.parallel_config.tensor_parallel_size,
            )
        else:
            self._worker = _WorkerSide(self.cfg, vllm_config, self.engine_id)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # layer-wise: the per-layer hooks must run inside captured graphs

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
        self._sched.update_connector_output(set(connector_output.finished_recving or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        port = (
            self.cfg.side_channel_port
        )  # TP rank r listens on port + r; decode rank r dials the same offset
        return self._sched.request_finished(request, self.cfg.advertised_host(), port)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, DisaggConnectorMetadata)
            self._worker.bind(connector_metadata)

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
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.results()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
