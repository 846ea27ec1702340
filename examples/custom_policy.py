"""An example routing policy: pin long prompts to one decode instance, serve short ones where their prefix is cached.

A policy is a plain class with ``plan(request, cluster) -> Plan`` (and, optionally, ``observe(outcome)``). It needs
no running proxy, so it can be unit-tested, or replayed against a trace in the simulator, before it serves traffic.

Use it with::

    --policy examples/custom_policy.py:PinLongPromptsPolicy --policy-args '{"threshold_tokens": 4096}'

(the proxy names an instance ``host:port`` unless its flag says ``;id=NAME``: give the decode instance to pin an id
that starts with ``pin_prefix``, e.g. ``--decode 'http://10.0.0.5:8000;id=d-long'`` and ``"pin_prefix": "d-long"``),
or from Python (keyword arguments go to the constructor)::

    from vllm_disagg.router.policies import load_policy
    policy = load_policy("examples/custom_policy.py:PinLongPromptsPolicy", threshold_tokens=4096, pin_prefix="d1")
"""

from __future__ import annotations

from vllm_disagg.router import ClusterView, NoRoute, Plan, Policy, RequestView


class PinLongPromptsPolicy(Policy):
    """Prompts above ``threshold_tokens``: prefill on the least-busy prefill instance and transfer to the decode
    instance whose id starts with ``pin_prefix`` (say, one with a larger KV cache reserved for long contexts).
    Everything else: no transfer; the decode instance holding the longest cached prefix of the prompt prefills it.
    """

    def __init__(self, threshold_tokens: int = 2048, pin_prefix: str = "d0") -> None:
        self.threshold_tokens = threshold_tokens
        self.pin_prefix = pin_prefix

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        decodes = sorted(
            cluster.decode, key=lambda i: i.id
        )  # healthy and able to decode; sorted: deterministic
        if not decodes:
            raise NoRoute("no healthy decode instance")  # the proxy answers 503 with Retry-After

        if request.prompt_tokens > self.threshold_tokens:
            pinned = [d for d in decodes if d.id.startswith(self.pin_prefix)]
            prefills = sorted(
                (p for p in cluster.prefill if pinned and p.id != pinned[0].id),
                key=lambda p: (p.in_flight + p.waiting, p.id),
            )
            if pinned and prefills:
                backup = prefills[1].id if len(prefills) > 1 else None
                return Plan.transfer(
                    prefills[0].id, pinned[0].id, reason="pinned_long_prompt", backup_prefill=backup
                )

        # Short prompt, or no pinned instance or prefill instance available: prefill where the cache helps most.
        best = min(decodes, key=lambda d: (-d.cached_tokens, d.in_flight + d.waiting, d.id))
        if best.role == "both":
            return Plan.colocated(best.id, reason="longest_cached_prefix")
        return Plan.recompute(best.id, reason="longest_cached_prefix")
