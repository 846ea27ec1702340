"""One serving instance in the simulator: a vLLM-like continuous-batching scheduler, as a pure state machine.

The event loop (``simulate.py``) calls ``start_iteration`` when the engine is idle and ``finish_iteration`` when
the iteration's time has passed; the engine never looks at a clock of its own, so it is deterministic and cheap:
decoding sequences are tracked by the step at which they finish (a heap), not touched one by one per step.

Scheduling, per iteration:
  * sequences whose KV arrived by transfer join the decode batch first (they are cheap: one token each);
  * without chunked prefill, waiting prompts are prefilled whole, as many as fit ``max_batched_tokens``, in a
    prefill-only iteration: the decode batch waits for it (vLLM's prefill-first policy; the ITL spike);
  * with chunked prefill, every iteration runs all decodes plus prompt chunks filling the rest of the token budget.
Admission reserves a request's whole KV up front (prompt + output; prompt only for a prefill-only request, held
until its transfer completes), so there is no preemption.

Prefix cache: an instance remembers the shared prefixes (``Request.prefix``) of the prompts it computed or received
by transfer, least recently used first, up to its KV capacity. A prompt admitted for prefill whose prefix it holds
computes only the rest (whole blocks of the prefix are hits, and at least one token is computed, as in vLLM).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Literal

from vllm_disagg.planner.costmodel import BatchShape, StepModel
from vllm_disagg.planner.workload import Request
from vllm_disagg.policy.api import Plan, Role, StreamLengths

BLOCK_TOKENS = 16  # vLLM's default KV block: a prefix-cache hit is whole blocks

StackCpu = Literal["serial", "shared"]


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    chunked_prefill: bool = False
    kv_capacity_tokens: int | None = None  # None: the cost model's (unbounded if it has none)
    # CPU time per emitted token that the stack around the engines spends on the engines' cores (the API
    # servers detokenizing and streaming, the proxy, the client, as on a CPU host). It grows with the number of
    # streams, unlike a factor on the step. Where it is spent (``stack_cpu``): ``serial``, inside the emitting
    # instance's iteration; ``shared``, on every engine's core alike (``simulate.HostCores``), as the OS runs
    # short-lived stack work beside engines that each keep a core busy.
    token_overhead_s: float = 0.0
    stack_cpu: StackCpu = "shared"


@dataclass(eq=False)
class SimRequest:
    """A request's progress through the simulated cluster (mutable; owned by the event loop)."""

    req: Request
    plan: Plan | None = None
    prefill_only: bool = False  # true on the prefill instance of a transfer plan
    prefilled: int = 0
    cached: int = 0  # prompt tokens found in the computing instance's prefix cache at admission
    prefill_start: float | None = None
    prefill_end: float | None = None
    transfer_end: float | None = None
    exposed_transfer_s: float = 0.0
    first_token: float | None = None
    finish: float | None = None
    dropped: str = ""

    @property
    def prompt(self) -> int:
        return self.req.prompt_tokens

    @property
    def output(self) -> int:
        return self.req.output_tokens


@dataclass(frozen=True)
class IterationRecord:
    start: float
    duration: float
    prefill_tokens: int
    decode_seqs: int


@dataclass
class IterationOutcome:
    prefilled: list[SimRequest] = field(default_factory=list)  # prefill-only requests whose KV is complete
    finished: list[SimRequest] = field(default_factory=list)


class Engine:
    def __init__(
        self, instance_id: str, role: Role, cost: StepModel, cfg: EngineConfig, record: bool = False
    ) -> None:
        self.id, self.role, self.cost, self.cfg = instance_id, role, cost, cfg
        cap = cfg.kv_capacity_tokens if cfg.kv_capacity_tokens is not None else cost.kv_capacity_tokens
        self.capacity: int | None = cap
        self.waiting: deque[SimRequest] = deque()  # needs prefill here, not admitted yet
        self.prefilling: list[SimRequest] = []  # admitted, prompt partly computed
        self.ready: deque[SimRequest] = deque()  # KV arrived by transfer, waiting for a decode slot
        self._decoding: list[tuple[int, int, SimRequest]] = []  # (finish step, request id, request)
        self._pending_first: list[SimRequest] = []  # joined the decode batch with no token yet
        self.step = 0
        self.n_decoding = 0
        self.lengths = StreamLengths()  # the decoding requests' output lengths
        self.ctx_tokens = 0  # KV tokens of all decoding sequences
        self.used = 0
        self._reserved: dict[int, int] = {}
        self.busy = False
        self._chunks: list[tuple[SimRequest, int]] = []
        self._decode_ran = False
        self.emitting = 0  # tokens the iteration under way emits when it ends
        self.record = record
        self.iterations: list[IterationRecord] = []
        # prefix -> tokens held, least recently used first
        self._prefixes: OrderedDict[int, int] = OrderedDict()
        self._pending: dict[int, int] = {}  # prefix -> tokens of a prompt sent here and not computed yet

    # -- load, as a policy sees it (the proxy's ``InstanceView``: router.instances.Instance) ---------------------
    @property
    def prompts(self) -> int:
        """Prompts to compute here before their answers begin: queued or being computed (a transfer's prefill leg
        included). Transferred KV waiting for a decode slot is not one."""
        return len(self.waiting) + len(self.prefilling)

    @property
    def streams(self) -> int:
        """Requests decoding here."""
        return self.n_decoding

    @property
    def kv_usage(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0

    # -- prefix cache ----------------------------------------------------------------------------------------
    @staticmethod
    def _hit(held: dict[int, int], req: Request) -> int:
        """Prompt tokens of ``req`` a prefix held in ``held`` covers: whole blocks, at least one token left."""
        if req.prefix < 0:
            return 0
        hit = min(held.get(req.prefix, 0), req.prefix_tokens, req.prompt_tokens - 1)
        return max(hit, 0) // BLOCK_TOKENS * BLOCK_TOKENS

    def cached_for(self, req: Request) -> int:
        """Prompt tokens of ``req`` this instance's prefix cache holds."""
        return self._hit(self._prefixes, req)

    def routed_hit(self, req: Request) -> int:
        """What the proxy's prefix index reports for ``req`` here: the cache's hit, or a prompt of its prefix sent
        here and not computed yet (``expect``; the index's pending entries)."""
        return max(self.cached_for(req), self._hit(self._pending, req))

    def expect(self, req: Request) -> None:
        """A prompt was sent here to compute: the proxy's index counts its prefix here now."""
        if req.prefix >= 0 and req.prefix_tokens > 0:
            self._pending[req.prefix] = max(self._pending.get(req.prefix, 0), req.prefix_tokens)

    def remember(self, req: Request) -> None:
        """The instance holds ``req``'s prefix now (it computed or received the prompt's KV)."""
        if req.prefix < 0 or req.prefix_tokens <= 0:
            return
        self._pending.pop(req.prefix, None)
        held = self._prefixes.pop(req.prefix, 0)
        self._prefixes[req.prefix] = max(held, min(req.prefix_tokens, req.prompt_tokens))
        if self.capacity is not None:
            while sum(self._prefixes.values()) > self.capacity:
                self._prefixes.popitem(last=False)

    def _start_prefill(self, r: SimRequest) -> None:
        """An admitted prompt starts computing: from the end of its prefix-cache hit."""
        if r.prefilled == 0:
            r.cached = self.cached_for(r.req)
            r.prefilled = r.cached
            if r.cached:
                self._prefixes.move_to_end(r.req.prefix)
        self.prefilling.append(r)

    # -- intake ----------------------------------------------------------------------------------------------
    def fits(self, r: SimRequest, prefill_only: bool = False) -> bool:
        """Whether the request could ever be admitted here (else it would block the queue forever)."""
        return self.capacity is None or self._need(r, prefill_only) <= self.capacity

    def submit(self, r: SimRequest) -> None:
        """Queue a request that needs its prompt computed here (``r.prefill_only`` decides what happens after)."""
        self.waiting.append(r)

    def receive(self, r: SimRequest) -> None:
        """Queue a request whose KV arrived by transfer; it decodes here (and holds its prefix from now on)."""
        self.remember(r.req)
        self.ready.append(r)

    def release(self, r: SimRequest) -> None:
        """Free the request's KV reservation (prefill side: after the transfer; decode side: at finish)."""
        self.used -= self._reserved.pop(r.req.id, 0)

    # -- iterations ------------------------------------------------------------------------------------------
    def _need(self, r: SimRequest, prefill_only: bool) -> int:
        return r.prompt if prefill_only else r.prompt + r.output

    def _admit(self, r: SimRequest, prefill_only: bool) -> bool:
        need = self._need(r, prefill_only)
        if self.n_decoding + len(self.prefilling) >= self.cfg.max_num_seqs:
            return False
        if self.capacity is not None and self.used + need > self.capacity:
            return False
        self.used += need
        self._reserved[r.req.id] = need
        return True

    def _join_decode(self, r: SimRequest, generated: int) -> None:
        heapq.heappush(self._decoding, (self.step + r.output - generated, r.req.id, r))
        self.n_decoding += 1
        self.lengths.add(r.output)
        self.ctx_tokens += r.prompt + generated

    def start_iteration(self, now: float, slowdown: float = 1.0) -> float | None:
        """Pick this iteration's work; returns its duration (``slowdown`` times the cost model's: the share of the
        engine's core that other processes take), or None when there is nothing to do."""
        assert not self.busy
        while self.ready and self._admit(self.ready[0], False):
            r = self.ready.popleft()
            self._join_decode(r, 0)
            self._pending_first.append(r)
        chunks: list[tuple[SimRequest, int]] = []
        decode_seqs = self.n_decoding
        if self.cfg.chunked_prefill:
            budget = self.cfg.max_batched_tokens - decode_seqs
            for r in self.prefilling:
                if budget <= 0:
                    break
                n = min(r.prompt - r.prefilled, budget)
                chunks.append((r, n))
                budget -= n
            while budget > 0 and self.waiting and self._admit(self.waiting[0], self.waiting[0].prefill_only):
                r = self.waiting.popleft()
                self._start_prefill(r)
                n = min(r.prompt - r.prefilled, budget)
                chunks.append((r, n))
                budget -= n
        else:
            total = 0
            while self.waiting and (
                total == 0 or total + self.waiting[0].prompt <= self.cfg.max_batched_tokens
            ):
                if not self._admit(self.waiting[0], self.waiting[0].prefill_only):
                    break
                r = self.waiting.popleft()
                self._start_prefill(r)
                chunks.append((r, r.prompt - r.prefilled))
                total += r.prompt - r.prefilled
            if chunks:
                decode_seqs = 0  # prefill-first: the decode batch sits this iteration out
        if not chunks and not decode_seqs:
            return None
        pairs = 0.0
        ctx = 0
        for r, n in chunks:
            if r.prefill_start is None:
                r.prefill_start = now
            pairs += n * (r.prefilled + n / 2)
            ctx += r.prefilled
        batch = BatchShape(
            sum(n for _, n in chunks),
            pairs,
            ctx,
            decode_seqs,
            self.ctx_tokens if decode_seqs else 0,
            len(chunks),
        )
        duration = self.cost.step_s(batch) * slowdown
        self.emitting = decode_seqs + sum(1 for r, n in chunks if r.prefilled + n >= r.prompt)
        if self.cfg.token_overhead_s and self.cfg.stack_cpu == "serial":
            duration += self.cfg.token_overhead_s * self.emitting
        self.busy = True
        self._chunks = chunks
        self._decode_ran = decode_seqs > 0
        if self.record:
            self.iterations.append(IterationRecord(now, duration, batch.prefill_tokens, decode_seqs))
        return duration

    def finish_iteration(self, now: float) -> IterationOutcome:
        """Apply the iteration's effects at its end time ``now``."""
        assert self.busy
        self.busy = False
        out = IterationOutcome()
        if self._decode_ran:
            self.step += 1
            self.ctx_tokens += self.n_decoding
            for r in self._pending_first:
                r.first_token = now
            self._pending_first.clear()
            while self._decoding and self._decoding[0][0] <= self.step:
                r = heapq.heappop(self._decoding)[2]
                self.n_decoding -= 1
                self.lengths.remove(r.output)
                self.ctx_tokens -= r.prompt + r.output
                self._finish(r, now, out)
        for r, n in self._chunks:
            r.prefilled += n
            if r.prefilled < r.prompt:
                continue
            self.prefilling.remove(r)
            r.prefill_end = now
            self.remember(r.req)
            if r.prefill_only:
                out.prefilled.append(r)
                continue
            r.first_token = now  # the prefill's forward pass samples the first token
            if r.output <= 1:
                self._finish(r, now, out)
            else:
                self._join_decode(r, 1)
        self._chunks = []
        return out

    def _finish(self, r: SimRequest, now: float, out: IterationOutcome) -> None:
        r.finish = now
        self.release(r)
        out.finished.append(r)
