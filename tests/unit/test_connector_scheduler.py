"""DisaggConnector's scheduler side and start-up checks against hostile and unusual requests, without a vLLM server.

Requests are the attributes vLLM's scheduler hands the connector; what is asserted is what the scheduler would see:
no exception inside ``schedule()``, no remote load for a bad or shared transfer id, preempted sends paused until they
resume, and prefill told when decode will not load.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_disagg.config import ConnectorConfig  # noqa: E402
from vllm_disagg.connectors.disagg_connector import (  # noqa: E402
    _check_topology,
    _cpu_kv_layout_tag,
    _layer_order,
    _SchedulerSide,
    prompt_hash,
)
from vllm_disagg.transfer_params import (  # noqa: E402
    LOAD_OUTCOME_KEY,
    PROOF_KEY,
    RemoteDecode,
    RemotePrefill,
    TransferParamsError,
    decode_proof,
    host_allowed,
    parse_transfer_params,
    prefill_proof,
)

BS = 16


def request(req_id: str, params: Any, prompt: int = 40, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params=params,
        num_prompt_tokens=prompt,
        prompt_token_ids=list(range(prompt)),
        num_computed_tokens=computed,
        status=SimpleNamespace(name="FINISHED_STOPPED"),
    )


def sched(**cfg: Any) -> _SchedulerSide:
    return _SchedulerSide(ConnectorConfig(**cfg), "engine-p", BS, 1)


def blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def step(
    new: list[tuple[str, list[int]]] = (), tokens: dict[str, int] | None = None, preempted: set[str] = ()
):  # type: ignore[assignment]
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,)) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens=tokens or {},
        preempted_req_ids=set(preempted),
    )


PREFILL = {"do_remote_prefill": True, "transfer_id": "T1", "remote_host": "10.0.0.5", "remote_port": 5700}

HOSTILE: list[Any] = [
    {**PREFILL, "remote_port": "abc"},
    {**PREFILL, "remote_port": -1},
    {**PREFILL, "remote_port": 70000},
    {**PREFILL, "remote_port": 5700.5},
    {**PREFILL, "remote_port": True},
    {**PREFILL, "remote_port": None},
    {**PREFILL, "remote_port": "²"},  # isdigit() but not int(): once killed the engine
    {**PREFILL, "remote_port": "١٢٣٤٥"},
    {**PREFILL, "remote_host": "localhost\n"},
    {**PREFILL, "transfer_id": "t\n"},
    {**PREFILL, "disagg_proof": 5},
    {**PREFILL, "disagg_proof": "x" * 10_000},
    {**PREFILL, "remote_host": "bad host"},
    {**PREFILL, "remote_host": "*"},
    {**PREFILL, "remote_host": "%"},
    {**PREFILL, "remote_host": ""},
    {**PREFILL, "remote_host": ["10.0.0.5"]},
    {**PREFILL, "remote_host": "a" * 300},
    {**PREFILL, "transfer_id": "x" * 500},
    {**PREFILL, "transfer_id": 12},
    {**PREFILL, "transfer_id": "has space"},
    {**PREFILL, "do_remote_prefill": "yes"},
    {**PREFILL, "do_remote_decode": True},
    {"do_remote_decode": True, "transfer_id": {"a": 1}},
    ["do_remote_prefill"],
    "do_remote_prefill",
]


@pytest.mark.parametrize("params", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_params_never_raise_and_never_plan_a_load(params: Any) -> None:
    s = sched()
    r = request("r", params)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # served locally: nothing raised in schedule()
    s.update_state_after_alloc(r, blocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(step([("r", [1, 2, 3])], {"r": 40}))
    assert not meta.loads and not meta.sends
    assert s.request_finished(r, "10.0.0.1") == (False, None)
    assert s.rejected == 1 and not s.roles and not s.tids


def test_good_params_still_plan_the_load() -> None:
    s = sched()
    r = request("r", PREFILL)
    assert s.get_num_new_matched_tokens(r, 16) == (24, True)
    s.update_state_after_alloc(r, blocks([7, 8, 9]), 24)
    meta = s.build_connector_meta(step())
    (load,) = meta.loads
    assert (load.host, load.port, load.dest_blocks, load.first_block) == ("10.0.0.5", 5700, [8, 9], 1)
    assert load.prompt_hash == prompt_hash(r) and prompt_hash(r) != prompt_hash(request("x", None, prompt=41))


def test_allowlist_keeps_decode_from_dialling_a_client_named_host() -> None:
    s = sched(allowed_prefill_hosts=["10.1.0.0/16", "prefill-0.svc"])
    assert s.get_num_new_matched_tokens(request("a", PREFILL), 0) == (0, False)
    ok = {**PREFILL, "transfer_id": "T2", "remote_host": "10.1.2.3"}
    assert s.get_num_new_matched_tokens(request("b", ok), 0) == (40, True)
    named = {**PREFILL, "transfer_id": "T3", "remote_host": "prefill-0.svc"}
    assert s.get_num_new_matched_tokens(request("c", named), 0) == (40, True)


def test_siblings_sharing_a_transfer_id_are_served_locally() -> None:
    """n > 1: vLLM's children carry the same params. Only the first moves KV, on either role."""
    s = sched()
    a, b = request("a", PREFILL), request("b", PREFILL)
    s.role(a)  # on_new_request, in arrival order
    s.role(b)
    assert s.get_num_new_matched_tokens(a, 0) == (40, True)
    assert s.get_num_new_matched_tokens(b, 0) == (0, False)
    s.request_finished(b, "h")
    assert s.tids == {"T1": "a"}  # the sibling leaving never frees the owner's id
    p = sched()
    send = {"do_remote_decode": True, "transfer_id": "S"}
    c, d = request("c", send), request("d", send)
    p.get_num_new_matched_tokens(c, 0)
    p.get_num_new_matched_tokens(d, 0)
    assert set(p.sends) == {"c"}


def test_a_preempted_send_pauses_and_goes_on_from_the_resumed_requests_blocks() -> None:
    s = sched()
    r = request("r", {"do_remote_decode": True, "transfer_id": "S"}, prompt=64)
    s.get_num_new_matched_tokens(r, 0)
    meta = s.build_connector_meta(step([("r", [4, 5, 6, 7])], {"r": 32}))
    assert [b for _, b in meta.sends[0].blocks] == [4, 5] and meta.sends[0].prompt_hash
    r.num_computed_tokens = 32
    meta = s.build_connector_meta(step(tokens={}, preempted={"r"}))
    assert meta.preempted_sends == [("S", "r")] and not meta.sends
    # resumed with block 0 from the prefix cache (16 tokens computed) on new blocks: every complete block is
    # offered again from the new ids (the sender skips what went), and the send is not begun a second time
    r.num_computed_tokens = 16
    resumed = step(tokens={"r": 32})
    resumed.scheduled_cached_reqs = SimpleNamespace(
        req_ids=["r"], new_block_ids=[([20, 21, 22, 23],)], resumed_req_ids={"r"}
    )
    meta = s.build_connector_meta(resumed)
    assert meta.sends[0].blocks == [(0, 20), (1, 21), (2, 22)] and not meta.sends[0].first
    r.num_computed_tokens = 48
    meta = s.build_connector_meta(step(tokens={"r": 16}))
    assert meta.sends[0].blocks == [(3, 23)] and meta.sends[0].last
    r.num_computed_tokens = 64
    held, params = s.request_finished(r, "h")
    assert held and params is not None and params["transfer_id"] == "S"
    assert s.build_connector_meta(step()).finished_sends == [("S", False, "r")]


def test_a_preempted_send_that_never_resumes_is_aborted() -> None:
    s = sched()
    r = request("r", {"do_remote_decode": True, "transfer_id": "S"}, prompt=64)
    s.get_num_new_matched_tokens(r, 0)
    s.build_connector_meta(step([("r", [4, 5, 6, 7])], {"r": 32}))
    r.num_computed_tokens = 32
    assert s.build_connector_meta(step(tokens={}, preempted={"r"})).preempted_sends == [("S", "r")]
    r.num_computed_tokens = 0
    r.status = SimpleNamespace(name="FINISHED_ABORTED")  # the client went away while it waited
    held, params = s.request_finished(r, "h")
    assert held and params is None
    assert s.build_connector_meta(step()).finished_sends == [("S", True, "r")]


def test_decode_that_will_not_load_tells_prefill() -> None:
    s = sched()
    r = request("r", PREFILL)
    s.role(r)  # on_new_request: seen on arrival, aborted while queued
    assert s.request_finished(r, "h") == (False, None)
    assert s.build_connector_meta(step()).declines == [("T1", "10.0.0.5", 5700)]
    loaded = request("l", {**PREFILL, "transfer_id": "T9"})
    s.get_num_new_matched_tokens(loaded, 0)
    s.update_state_after_alloc(loaded, blocks([1, 2, 3]), 40)
    s.update_connector_output({"l"})
    s.request_finished(loaded, "h")
    assert not s.build_connector_meta(step()).declines  # it loaded: nothing to decline


def test_a_send_aborted_while_queued_tells_a_registered_decode() -> None:
    """A prefill request aborted before the scheduler ever considered it has no send yet; the decode that registered
    for its transfer (the parallel flow) is told at once instead of waiting out its load timeout."""
    s = sched()
    r = request("r", {"do_remote_decode": True, "transfer_id": "S"})
    s.role(r)  # on_new_request; aborted before get_num_new_matched_tokens
    assert s.request_finished(r, "h") == (False, None)
    assert s.build_connector_meta(step()).unstarted_sends == ["S"]
    a, b = (
        request("a", {"do_remote_decode": True, "transfer_id": "D"}),
        request("b", {"do_remote_decode": True, "transfer_id": "D"}),
    )
    s.role(a)
    s.role(b)  # a sibling sharing the id: its leaving never aborts the owner's transfer
    s.request_finished(b, "h")
    assert s.build_connector_meta(step()).unstarted_sends == []


def test_prefill_advertises_its_own_base_port() -> None:
    s = _SchedulerSide(ConnectorConfig(side_channel_port=6000), "e", BS, 2, port_offset=4)
    r = request("r", {"do_remote_decode": True, "transfer_id": "S"})
    s.get_num_new_matched_tokens(r, 0)
    s.build_connector_meta(step([("r", [1, 2, 3])], {"r": 40}))
    r.num_computed_tokens = 40
    _, params = s.request_finished(r, "10.0.0.1")
    assert params is not None and params["remote_port"] == 6004 and params["tp_size"] == 2


def _vllm_config(
    pp: int = 1, tp: int = 1, dp_index: int = 0, mla: bool = False, dcp: int = 1, pcp: int = 1
) -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=pp,
            tensor_parallel_size=tp,
            data_parallel_index=dp_index,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=pcp,
        ),
        model_config=SimpleNamespace(use_mla=mla),
    )


def test_topology_pp_mla_and_hybrid_are_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2"):
        _check_topology(_vllm_config(pp=2), None)
    with pytest.raises(ValueError, match="MLA"):
        _check_topology(_vllm_config(mla=True), None)
    # context parallelism: vLLM's block ids then span block_size x dcp tokens interleaved over ranks
    with pytest.raises(ValueError, match="--decode-context-parallel-size 2"):
        _check_topology(_vllm_config(tp=2, dcp=2), None)
    with pytest.raises(ValueError, match="--prefill-context-parallel-size 2"):
        _check_topology(_vllm_config(pcp=2), None)
    with pytest.raises(ValueError, match="hybrid"):
        _check_topology(_vllm_config(), SimpleNamespace(kv_cache_groups=[1, 2]))
    assert _check_topology(_vllm_config(tp=4, dp_index=2), SimpleNamespace(kv_cache_groups=[1])) == 8


def test_layer_names_of_common_model_families_sort_in_model_order() -> None:
    for fmt in ("model.layers.{}.self_attn.attn", "transformer.h.{}.attn.attn", "transformer.blocks.{}.attn"):
        names = [fmt.format(i) for i in (10, 2, 0, 1, 11)]
        assert sorted(names, key=_layer_order) == [fmt.format(i) for i in (0, 1, 2, 10, 11)]


def test_parse_transfer_params_types_and_ranges() -> None:
    assert parse_transfer_params(None) is None
    assert parse_transfer_params({}) is None
    assert parse_transfer_params({"do_remote_decode": True}) == RemoteDecode(transfer_id="")
    assert parse_transfer_params({**PREFILL, "remote_port": "5701"}) == RemotePrefill("T1", "10.0.0.5", 5701)
    assert parse_transfer_params({**PREFILL, "remote_host": "[::1]"}) == RemotePrefill("T1", "::1", 5700)
    with pytest.raises(TransferParamsError, match="remote_port"):
        parse_transfer_params({**PREFILL, "remote_port": "abc"})
    with pytest.raises(TransferParamsError, match="remote_host"):
        parse_transfer_params({**PREFILL, "remote_host": "bad host"})
    with pytest.raises(TransferParamsError, match="transfer_id"):
        parse_transfer_params({**PREFILL, "transfer_id": None})
    assert host_allowed("10.0.0.5", None)
    assert host_allowed("10.0.0.5", ["10.0.0.0/24"]) and not host_allowed("10.0.1.5", ["10.0.0.0/24"])


def test_a_parser_bug_still_never_raises_inside_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_disagg.connectors.disagg_connector as dc

    def buggy(params: object) -> None:
        raise KeyError("a bug in the parser")

    monkeypatch.setattr(dc, "parse_transfer_params", buggy)
    s = sched()
    assert s.get_num_new_matched_tokens(request("r", PREFILL), 0) == (0, False)
    assert s.rejected == 1


def test_decode_only_instances_keep_full_cuda_graphs_and_never_send() -> None:
    from vllm_disagg.connectors.disagg_connector import DisaggConnector

    assert DisaggConnector.requires_piecewise_for_cudagraph({}) is True
    assert DisaggConnector.requires_piecewise_for_cudagraph({"decode_only": True}) is False
    s = sched(decode_only=True)
    r = request("r", {"do_remote_decode": True, "transfer_id": "S"})
    s.get_num_new_matched_tokens(r, 0)
    assert not s.sends and s.rejected == 1
    assert s.get_num_new_matched_tokens(request("d", PREFILL), 0) == (40, True)  # it still loads


def test_the_cpu_layout_tag_tells_amx_packed_caches_from_vector_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM packs a bf16 cache for AMX tiles on an AMX host and lays the same shape out for its vector kernels
    elsewhere; torch's capability string reads "AVX512" on both, so the tag must name the kernels, else the two
    hosts pair and decode attends over bytes it cannot read."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    amx = _cpu_kv_layout_tag(torch.bfloat16, 128, 64, "auto")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    vec = _cpu_kv_layout_tag(torch.bfloat16, 128, 64, "auto")
    assert amx.endswith(":amx") and vec.endswith(":vec") and amx != vec
    # an fp32 model takes the vector kernels on either host; a block of 16 tokens the 16-wide ones
    assert _cpu_kv_layout_tag(torch.float32, 128, 64, "auto").endswith(":vec")
    assert _cpu_kv_layout_tag(torch.float32, 16, 64, "auto").endswith(":vec16")


def test_blocks_held_for_a_transfer_make_vllm_wait_rather_than_preempt() -> None:
    """While a finished prefill's blocks wait for decode, vLLM is told they come back soon (so it does not preempt
    a running request for them); once the worker reports the send done, or the hold outlives its deadline (a lost
    report), it is not."""
    s = sched(lease_s=10, load_timeout_s=10)
    r = request("r", {"do_remote_decode": True, "transfer_id": "S"}, prompt=32)
    s.get_num_new_matched_tokens(r, 0)
    s.build_connector_meta(step([("r", [4, 5])], {"r": 32}))
    r.num_computed_tokens = 32
    assert not s.has_pending_block_frees(time.monotonic())
    held, _ = s.request_finished(r, "h")
    assert held and s.has_pending_block_frees(time.monotonic())
    s.update_connector_output(set(), {"r"})
    assert not s.has_pending_block_frees(time.monotonic())
    lost = request("l", {"do_remote_decode": True, "transfer_id": "L"}, prompt=32)
    s.get_num_new_matched_tokens(lost, 0)
    s.build_connector_meta(step([("l", [6, 7])], {"l": 32}))
    lost.num_computed_tokens = 32
    s.request_finished(lost, "h")
    assert s.has_pending_block_frees(time.monotonic())
    assert not s.has_pending_block_frees(time.monotonic() + 16)  # past lease + 5 s: its report was lost


def test_a_decode_whose_load_failed_says_so_in_its_answer() -> None:
    """vLLM recomputes a prompt whose load failed; the request's finished params say so (a non-streamed answer
    carries them), so the proxy can report the fallback instead of a transfer that did not happen."""
    s = sched()
    failed, loaded = request("f", PREFILL), request("l", {**PREFILL, "transfer_id": "T9"})
    for r in (failed, loaded):
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, blocks([1, 2, 3]), 40)
    s.update_connector_output({"f", "l"}, set(), {"f"})
    assert s.request_finished(failed, "h") == (False, {LOAD_OUTCOME_KEY: "failed"})
    assert s.request_finished(loaded, "h") == (False, None)
    assert not s.load_failed


def test_with_a_secret_decode_dials_only_prefills_vouched_for() -> None:
    """A client calling the instance directly cannot name the prefill it dials: with a shared secret the params
    must carry the proof the proxy (or the prefill that answered) computed with it."""
    secret = "s3cret"
    s = sched(shared_secret=secret)
    assert s.get_num_new_matched_tokens(request("a", PREFILL), 0) == (0, False)  # no proof: served locally
    forged = {**PREFILL, "transfer_id": "T2", PROOF_KEY: prefill_proof(b"other", "T2", "10.0.0.5", 5700)}
    assert s.get_num_new_matched_tokens(request("b", forged), 0) == (0, False)
    moved = {
        **PREFILL,
        "transfer_id": "T3",
        PROOF_KEY: prefill_proof(secret.encode(), "T4", "10.0.0.5", 5700),
    }
    assert s.get_num_new_matched_tokens(request("c", moved), 0) == (0, False)  # a proof for another transfer
    rehost = {**PREFILL, "transfer_id": "T5", "remote_host": "10.6.6.6"}
    rehost[PROOF_KEY] = prefill_proof(secret.encode(), "T5", "10.0.0.5", 5700)
    assert s.get_num_new_matched_tokens(request("d", rehost), 0) == (0, False)  # the proof names another host
    assert s.rejected == 4
    ok = {**PREFILL, "transfer_id": "T6", PROOF_KEY: prefill_proof(secret.encode(), "T6", "10.0.0.5", 5700)}
    assert s.get_num_new_matched_tokens(request("e", ok), 0) == (40, True)
    assert sched().get_num_new_matched_tokens(request("f", PREFILL), 0) == (
        40,
        True,
    )  # no secret: nothing to prove


def test_with_a_secret_an_unvouched_hold_is_marked_and_the_answer_vouches_for_this_prefill() -> None:
    secret = b"s3cret"
    s = sched(shared_secret=secret.decode())
    plain = request("p", {"do_remote_decode": True, "transfer_id": "S1"})
    vouched = request(
        "v", {"do_remote_decode": True, "transfer_id": "S2", PROOF_KEY: decode_proof(secret, "S2")}
    )
    for r in (plain, vouched):
        s.get_num_new_matched_tokens(r, 0)
    meta = s.build_connector_meta(step([("p", [1, 2, 3]), ("v", [4, 5, 6])], {"p": 40, "v": 40}))
    assert {c.req_id: c.vouched for c in meta.sends} == {"p": False, "v": True}
    vouched.num_computed_tokens = 40
    _, params = s.request_finished(vouched, "10.0.0.1")
    assert params is not None
    again = parse_transfer_params(params)
    assert isinstance(again, RemotePrefill) and again.vouched(secret)  # decode will dial this prefill
