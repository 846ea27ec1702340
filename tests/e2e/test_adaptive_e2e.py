"""Two real vLLM instances given to the proxy as ``--both`` with their side channels (the adaptive design): a request's
KV moves in either direction and the greedy answer equals the one instance serving it alone; without side channels
the same instances are never paired."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from support.pd_pair import PDPair, random_prompt
from support.vllm_servers import SECRET, metric, wait_kv_idle

from vllm_disagg.tools.harness import ProxyServer

pytestmark = pytest.mark.vllm

EXTERNAL = ("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')

# Transfers in turn from each instance to the other, whatever the load: the direction is what the test controls.
ALTERNATING = """
from vllm_disagg.policy.api import Plan
from vllm_disagg.policy.cost_model import transfer_pairs


class Alternating:
    def __init__(self):
        self.n = 0

    def plan(self, request, cluster):
        pairs = transfer_pairs(cluster)
        p, d = pairs[self.n % len(pairs)]
        self.n += 1
        return Plan.transfer(p.id, d.id, reason="alternating")
"""


def _body(model: str, prompt: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_both_instances_hand_kv_over_in_either_direction(
    pd_pair: PDPair, tiny_model: str, tmp_path: Path
) -> None:
    policy = tmp_path / "alternating.py"
    policy.write_text(ALTERNATING)
    args = ["--both", pd_pair.spec("prefill"), "--both", pd_pair.spec("decode"), "--shared-secret", SECRET,
            "--policy", f"{policy}:Alternating"]  # fmt: skip
    servers = {"prefill": pd_pair.prefill, "decode": pd_pair.decode}
    with ProxyServer("unused", args=args, name="proxy-adaptive") as proxy:
        seen = set()
        for i in range(2):
            prompt = random_prompt(900, 17600 + i)
            external = {k: metric(s, *EXTERNAL) for k, s in servers.items()}
            r = httpx.post(proxy.url + "/v1/completions", json=_body(tiny_model, prompt), timeout=120)
            assert r.status_code == 200, r.text
            path = r.headers["x-disagg-path"]
            assert path.startswith("transfer"), path
            fields = dict(part.strip().split("=", 1) for part in path.split(";")[1:])
            sender, receiver = fields["prefill"], fields["decode"]
            seen.add((sender, receiver))
            # the receiver loaded the prompt's KV (all but its last, partial block) instead of computing it
            assert metric(servers[receiver], *EXTERNAL) - external[receiver] >= 768, path
            # the sender computed the prompt itself: served alone there, the greedy answer is the colocated one
            alone = httpx.post(
                servers[sender].url + "/v1/completions", json=_body(tiny_model, prompt), timeout=120
            )
            assert r.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"], path
        assert seen == {("prefill", "decode"), ("decode", "prefill")}
    for server in servers.values():
        wait_kv_idle(server)


def test_both_instances_without_side_channels_are_never_paired(pd_pair: PDPair, tiny_model: str) -> None:
    args = ["--both", pd_pair.prefill.url, "--both", pd_pair.decode.url, "--policy", "always-transfer"]
    with ProxyServer("unused", args=args, name="proxy-colocated") as proxy:
        r = httpx.post(
            proxy.url + "/v1/completions", json=_body(tiny_model, random_prompt(900, 17700)), timeout=120
        )
        assert r.status_code == 200
        assert r.headers["x-disagg-path"].startswith("colocated"), r.headers["x-disagg-path"]
        assert "no_pair" in r.headers["x-disagg-path"]
