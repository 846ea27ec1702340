"""The routing-policy API: what a policy sees (RequestView, ClusterView) and what it returns (Plan).

A policy is a plain Python class with ``plan(request, cluster) -> Plan`` and, optionally,
``observe(outcome) -> None`` and ``forget_instance(instance_id) -> None`` (called when an instance leaves the pool:
state kept per instance id would otherwise grow with every pod a rollout replaces). It needs no running proxy: the proxy, the simulator and a unit test all call it the
same way, so a policy can be replayed offline against a trace before it serves traffic. Both call ``plan`` inline
(the proxy on its event loop, for every request: it must be a plain method, and fast) and check what it returns
(``guard.py``): a plan that cannot be served is replaced by least-loaded's for that request.

A policy that reads neither ``RequestView.prompt_tokens`` nor any ``cached_tokens``/``tier_tokens`` can say so with a
class attribute ``needs_tokens = False``: the proxy then skips tokenization and the prefix index for its requests
(the prompt length it sees is an estimate from the characters). The default is True.

Three plans:
  * ``Plan.transfer(prefill, decode)``: prefill on one instance, stream the KV layer by layer to the other, decode there.
  * ``Plan.recompute(decode)``: the decode instance prefills the uncached part of the prompt itself (no transfer).
  * ``Plan.colocated(instance)``: one instance does everything (the fallback when there is no usable pair).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, overload, runtime_checkable

T = TypeVar("T")
Mode = Literal["transfer", "recompute", "colocated"]
Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, init=False)
class InstanceView:
    """One serving instance as the policy sees it at decision time."""

    id: str
    role: Role
    healthy: bool = True
    in_flight: int = 0  # requests the proxy has in flight on it
    # prompts it has to compute before their answers begin (queued or being computed; a transfer's prefill leg until
    # its hand-off, not a decode leg waiting for KV), and its streams (past their first token): the proxy's own as
    # they are, other senders' from vLLM's /metrics
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0..1
    cached_tokens: int = 0  # prompt tokens of *this* request it already holds in its prefix cache
    # the next prompt tokens after ``cached_tokens`` that a KV tier beneath it (LMCache CPU/disk) holds: loading
    # them costs tier bandwidth, not a prefill
    tier_tokens: int = 0
    # runs a KV connector the proxy could describe (its side channel answered): two "both" instances that both do
    # can hand a request's KV from one to the other; for "prefill" and "decode" instances the role implies it
    kv_connector: bool = False
    # the output lengths (max_tokens as sent) of those of its streams whose sender knows them: how many, the
    # shortest, and the sum of 1 / (length - 1) over them (``StreamLengths``). A stall of s seconds adds
    # s / (length - 1) to a stream's TPOT: one long prefill can push a short stream past a TPOT target that a long
    # stream hardly notices
    known_streams: int = 0
    shortest_stream: int = 0
    stall_sensitivity: float = 0.0

    def __init__(
        self,
        id: str,  # noqa: A002 (the field's name)
        role: Role,
        healthy: bool = True,
        in_flight: int = 0,
        waiting: int = 0,
        running: int = 0,
        kv_usage: float = 0.0,
        cached_tokens: int = 0,
        tier_tokens: int = 0,
        kv_connector: bool = False,
        known_streams: int = 0,
        shortest_stream: int = 0,
        stall_sensitivity: float = 0.0,
    ) -> None:
        # The views, plans and outcomes are built several times per request: their ``__init__`` fills ``__dict__``
        # directly. A frozen dataclass's generated one calls ``object.__setattr__`` per field (~4 µs for ten fields on
        # a slow core, against ~1 µs). Assignment after construction still raises; the signature is checked against
        # the fields by tests/unit/test_policies.py.
        d = self.__dict__
        d["id"], d["role"], d["healthy"], d["in_flight"], d["waiting"] = id, role, healthy, in_flight, waiting
        d["running"], d["kv_usage"], d["cached_tokens"] = running, kv_usage, cached_tokens
        d["tier_tokens"], d["kv_connector"] = tier_tokens, kv_connector
        d["known_streams"], d["shortest_stream"] = known_streams, shortest_stream
        d["stall_sensitivity"] = stall_sensitivity

    @property
    def can_prefill(self) -> bool:
        return self.healthy and self.role in ("prefill", "both")

    @property
    def can_decode(self) -> bool:
        return self.healthy and self.role in ("decode", "both")


class StreamLengths:
    """The output lengths of an instance's streams, as ``InstanceView`` carries them: a stall of s seconds adds
    s / (n - 1) to the TPOT of a stream of n output tokens, so what a prefill costs the streams it stalls depends on
    their lengths, not only on their number. Kept incrementally (a view is taken per request)."""

    __slots__ = ("_counts", "count", "sensitivity")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}  # output length -> streams of that length
        self.count = 0
        self.sensitivity = 0.0  # the sum of 1 / max(n - 1, 1) over the streams

    def add(self, tokens: int) -> None:
        self._counts[tokens] = self._counts.get(tokens, 0) + 1
        self.count += 1
        self.sensitivity += 1.0 / max(tokens - 1, 1)

    def remove(self, tokens: int) -> None:
        left = self._counts.get(tokens, 0) - 1
        if left < 0:
            raise ValueError(f"no stream of {tokens} output tokens to remove")
        if left:
            self._counts[tokens] = left
        else:
            del self._counts[tokens]
        self.count -= 1
        # reset when empty, so rounding does not accumulate over a long run
        self.sensitivity = self.sensitivity - 1.0 / max(tokens - 1, 1) if self.count else 0.0

    @property
    def shortest(self) -> int:
        """The shortest stream's output tokens (0 with none)."""
        return min(self._counts) if self._counts else 0


@dataclass(frozen=True, init=False)
class RequestView:
    request_id: str
    prompt_tokens: int
    max_tokens: int = 16
    stream: bool = False
    model: str = ""

    def __init__(
        self, request_id: str, prompt_tokens: int, max_tokens: int = 16, stream: bool = False, model: str = ""
    ) -> None:
        d = self.__dict__  # see InstanceView.__init__
        d["request_id"], d["prompt_tokens"], d["max_tokens"] = request_id, prompt_tokens, max_tokens
        d["stream"], d["model"] = stream, model


class _computed_once(Generic[T]):  # noqa: N801 (used as a decorator, like property)
    """``functools.cached_property`` without its lock (Python 3.11 takes one on every first read, and a view is
    read by one thread): the value is stored in the instance's ``__dict__``, which later reads find first."""

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _computed_once[T]: ...

    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object | None, owner: type) -> T | _computed_once[T]:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@dataclass(frozen=True, init=False)
class ClusterView:
    instances: tuple[InstanceView, ...]
    kv_bytes_per_token: int = 0  # from the model's KV geometry (0: unknown)
    link_bytes_per_s: float = 0.0  # measured KV transfer bandwidth between pools (0: unknown)
    tier_bytes_per_s: float = 0.0  # load bandwidth from the KV tier beneath an instance into it (0: unknown)
    # when the view was taken, in seconds from any fixed origin (the proxy's monotonic clock, the simulator's own):
    # what a policy that tracks rates over time reads instead of a wall clock, so a replay sees simulated time
    now_s: float | None = None

    def __init__(
        self,
        instances: tuple[InstanceView, ...],
        kv_bytes_per_token: int = 0,
        link_bytes_per_s: float = 0.0,
        tier_bytes_per_s: float = 0.0,
        now_s: float | None = None,
    ) -> None:
        d = self.__dict__  # see InstanceView.__init__
        d["instances"], d["kv_bytes_per_token"] = instances, kv_bytes_per_token
        d["link_bytes_per_s"], d["tier_bytes_per_s"], d["now_s"] = link_bytes_per_s, tier_bytes_per_s, now_s

    def get(self, instance_id: str) -> InstanceView:
        for inst in self.instances:
            if inst.id == instance_id:
                return inst
        raise KeyError(f"unknown instance {instance_id!r}")

    # Computed once per view (a policy asks for them several times per plan); the view itself never changes.
    @_computed_once
    def prefill(self) -> list[InstanceView]:
        return [i for i in self.instances if i.can_prefill]

    @_computed_once
    def decode(self) -> list[InstanceView]:
        return [i for i in self.instances if i.can_decode]


@dataclass(frozen=True, init=False)
class Plan:
    mode: Mode
    decode: str  # the instance that streams tokens to the client (for colocated: the only instance)
    prefill: str | None = None  # transfer only
    backup_prefill: str | None = None  # transfer only: tried if ``prefill`` fails before decode has its KV
    reason: str = ""
    alternatives: Sequence[str] = field(default=())  # what was considered and not taken, and why (for logs)

    def __init__(
        self,
        mode: Mode,
        decode: str,
        prefill: str | None = None,
        backup_prefill: str | None = None,
        reason: str = "",
        alternatives: Sequence[str] = (),
    ) -> None:
        d = self.__dict__  # see InstanceView.__init__
        d["mode"], d["decode"], d["prefill"], d["backup_prefill"] = mode, decode, prefill, backup_prefill
        d["reason"], d["alternatives"] = reason, alternatives

    @classmethod
    def transfer(cls, prefill: str, decode: str, reason: str = "", backup_prefill: str | None = None) -> Plan:
        return cls("transfer", decode=decode, prefill=prefill, backup_prefill=backup_prefill, reason=reason)

    @classmethod
    def recompute(cls, decode: str, reason: str = "") -> Plan:
        return cls("recompute", decode=decode, reason=reason)

    @classmethod
    def colocated(cls, instance: str, reason: str = "") -> Plan:
        return cls("colocated", decode=instance, reason=reason)

    @property
    def computing(self) -> str | None:
        """The instance that prefills the prompt: the prefill instance of a transfer, else the serving one."""
        return self.prefill if self.mode == "transfer" else self.decode

    def describe(self) -> str:
        """The value of the ``x-disagg-path`` response header."""
        if self.mode == "transfer":
            s = f"transfer; prefill={self.prefill}; decode={self.decode}"
        else:
            s = f"{self.mode}; instance={self.decode}"
        return s + (f"; reason={self.reason}" if self.reason else "")


@dataclass(frozen=True, init=False)
class Outcome:
    """What happened to a planned request (fed to ``Policy.observe`` for online calibration)."""

    request_id: str
    plan: Plan
    ok: bool
    prompt_tokens: int
    uncached_tokens: int = 0  # tokens the prefilling instance actually computed
    ttft_s: float | None = None
    prefill_s: float | None = None  # the prefill leg's duration (transfer) or None
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str = ""

    def __init__(
        self,
        request_id: str,
        plan: Plan,
        ok: bool,
        prompt_tokens: int,
        uncached_tokens: int = 0,
        ttft_s: float | None = None,
        prefill_s: float | None = None,
        e2e_s: float | None = None,
        output_tokens: int = 0,
        error: str = "",
    ) -> None:
        d = self.__dict__  # see InstanceView.__init__
        d["request_id"], d["plan"], d["ok"], d["prompt_tokens"] = request_id, plan, ok, prompt_tokens
        d["uncached_tokens"], d["ttft_s"], d["prefill_s"], d["e2e_s"] = (
            uncached_tokens,
            ttft_s,
            prefill_s,
            e2e_s,
        )
        d["output_tokens"], d["error"] = output_tokens, error


@runtime_checkable
class Policy(Protocol):
    def plan(self, request: RequestView, cluster: ClusterView) -> Plan: ...


class NoRoute(Exception):
    """No instance can serve the request (the proxy answers 503 with Retry-After)."""
