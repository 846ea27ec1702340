"""Planner arithmetic against hand-computed values, the profile's measurement math, and profile() over HTTP."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from vllm_disagg.kv_layout import kv_bytes_per_token
from vllm_disagg.planner.cli import main as planner_main
from vllm_disagg.planner.costmodel import BatchShape, ProfileCost, RooflineCost
from vllm_disagg.planner.hardware import (
    GPUS,
    LINKS,
    MEASURED_ENGINE_FIXED_S,
    MEASURED_PROXY_HOP_S,
    InstanceSpec,
    custom_gpu,
    gpu_preset,
    link_preset,
)
from vllm_disagg.planner.model import PRESET_CONFIGS, ModelSpec, dtype_bytes, preset_model
from vllm_disagg.planner.plan import (
    BreakEven,
    best_split,
    break_even_prompt_tokens,
    decode_rate,
    exposed_transfer_s,
    instances_for,
    kv_bytes_per_request,
    make_plan,
    prefill_rate,
    prefill_share,
    transfer_s,
)
from vllm_disagg.planner.profile import ProfileConfig, profile
from vllm_disagg.planner.profiledata import (
    DecodePoint,
    PrefillPoint,
    Profile,
    decode_step_from_streams,
    fit_line,
    fit_prefill,
    parse_kv_capacity,
    steady_gaps,
)

LLAMA3_8B = ModelSpec("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, params=8.03e9, dtype="bf16")
LLAMA3_70B = ModelSpec(
    "llama-3-70b", num_layers=80, num_kv_heads=8, head_dim=128, params=70.6e9, dtype="bf16"
)


@dataclass(frozen=True)
class FixedRates:
    """A cost model with exact rates: prefill at ``rp`` tokens/s, decode at ``rd`` tokens/s whatever the batch."""

    rp: float = 12_000.0
    rd: float = 800.0
    kv_capacity_tokens: int | None = None

    def step_s(self, batch: BatchShape) -> float:
        return batch.prefill_tokens / self.rp + batch.decode_seqs / self.rd


# -- model geometry ------------------------------------------------------------------------------------------
def test_kv_bytes_per_token_hand_values() -> None:
    assert LLAMA3_8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072 == 128 * 1024
    assert LLAMA3_70B.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327680 == 320 * 1024
    # the planner reuses the connector's formula
    assert LLAMA3_8B.kv_bytes_per_token == kv_bytes_per_token(32, 8, 128, 2)
    assert preset_model("llama-3-8b").kv_bytes_per_token == 131072
    assert preset_model("llama-3-70b").kv_bytes_per_token == 327680
    assert preset_model("qwen3-8b").kv_bytes_per_token == 144 * 1024
    fp8 = LLAMA3_70B.with_overrides(kv_dtype="fp8")
    assert fp8.kv_bytes_per_token == 163840 and fp8.weight_dtype_bytes == 2


def test_mla_latent_is_one_vector_per_layer() -> None:
    ds = preset_model("deepseek-v3")
    assert ds.mla_latent_dim == 512 + 64
    assert ds.kv_bytes_per_token == 61 * 576 * 2 == 70272  # ~70 KB/token
    # without the latent, the same config would cache K and V for all 128 heads of 128 dims: ~57x more
    no_mla = ds.with_overrides(mla_latent_dim=0, head_dim=128)
    assert no_mla.kv_bytes_per_token == kv_bytes_per_token(61, 128, 128, 2) == 3_997_696
    explicit = ModelSpec("mla", num_layers=61, num_kv_heads=1, head_dim=576, params=1e9, mla_latent_dim=576)
    assert explicit.kv_bytes_per_token == 70272


def test_param_estimates_from_hf_configs() -> None:
    assert preset_model("llama-3-8b").params == pytest.approx(8.03e9, rel=0.01)
    assert preset_model("llama-3-70b").params == pytest.approx(70.6e9, rel=0.01)
    ds = preset_model("deepseek-v3")
    assert ds.params == pytest.approx(671e9, rel=0.02)
    assert ds.active == pytest.approx(37e9, rel=0.03)
    # MoE: a decode step reads more experts as the batch grows, never more than all weights
    assert ds.weight_bytes_read(1) < ds.weight_bytes_read(64) < ds.weight_bytes_read(4096) <= ds.weight_bytes
    assert LLAMA3_8B.weight_bytes_read(1) == LLAMA3_8B.weight_bytes == 8.03e9 * 2  # no embedding declared


def test_flops_per_token_hand_values() -> None:
    """Llama-3 FLOPs by hand: per layer q and o are hidden^2 each, k and v hidden x 1024 each (8 KV heads x 128),
    the MLP 3 x hidden x intermediate; the 128,256 x hidden embedding is a lookup, the LM head of the same size runs
    once per sequence."""
    m8 = preset_model("llama-3-8b")
    layer8 = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert layer8 == 218_103_808
    assert m8.body_params == 32 * layer8 == 6_979_321_856
    assert m8.embed_params == m8.lm_head_params == 128256 * 4096 == 525_336_576
    assert m8.params == 32 * layer8 + 2 * 525_336_576  # 8.03e9: ~13% of it never multiplies a prompt token
    # a 2,048-token prefill: 2 x 6.98e9 x 2048 + one LM head + 4 x 32 x 4096 x 2048^2/2 attention pairs
    assert m8.forward_flops(2048, 1, 2048 * 2048 / 2) == (
        2 * 6_979_321_856 * 2048 + 2 * 525_336_576 + 4 * 32 * 4096 * 2_097_152
    )
    assert m8.forward_flops(2048, 1, 0) / 2048 == pytest.approx(13.96e9, rel=1e-3)  # not 2 x 8.03e9 = 16.06e9
    # a decode step of 16 sequences at 1,000 tokens of context: each pays the LM head
    assert (
        m8.forward_flops(16, 16, 16_000)
        == 2 * 6_979_321_856 * 16 + 2 * 525_336_576 * 16 + 4 * 32 * 4096 * 16_000
    )

    m70 = preset_model("llama-3-70b")
    layer70 = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    assert layer70 == 855_638_016
    assert m70.body_params == 80 * layer70 == 68_451_041_280
    assert m70.lm_head_params == 128256 * 8192 == 1_050_673_152
    assert m70.forward_flops(1, 1, 0) == 2 * 68_451_041_280 + 2 * 1_050_673_152

    # the roofline charges exactly that: prefill compute time = forward_flops / achieved FLOP/s
    inst = InstanceSpec(gpu_preset("h100-sxm"), tp=1, step_overhead_s=0.0)
    cost = RooflineCost(m8, inst)
    assert cost.compute_s(BatchShape.prefill(2048)) == pytest.approx(
        m8.forward_flops(2048, 1, 2048 * 2048 / 2) / (989e12 * 0.5)
    )
    # the embedding table is only indexed, so a decode step reads the other weights
    assert m8.weight_bytes_read(1) == (m8.params - 525_336_576) * 2
    # tied embeddings: one matrix, used as the LM head
    tied = ModelSpec.from_hf_config({**PRESET_CONFIGS["llama-3-8b"], "tie_word_embeddings": True})
    assert tied.embed_params == 0 and tied.lm_head_params == 525_336_576
    assert tied.body_params == m8.body_params


def test_hf_config_file_and_text_config(tmp_path: Path) -> None:
    cfg = {
        "text_config": {
            "num_hidden_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 512,
            "vocab_size": 1000,
            "tie_word_embeddings": True,
        },
        "torch_dtype": "float16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = ModelSpec.from_hf_config_file(tmp_path)
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.dtype) == (4, 2, 64, "float16")
    assert m.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    per_layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512
    assert m.params == 1000 * 256 + 4 * per_layer


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("float13")
    with pytest.raises(ValueError):
        ModelSpec("x", num_layers=0, num_kv_heads=8, head_dim=128, params=1e9)
    with pytest.raises(ValueError, match="unknown model"):
        preset_model("gpt-17")
    with pytest.raises(ValueError, match="no KV memory"):
        RooflineCost(preset_model("llama-3-70b"), InstanceSpec(gpu_preset("h100-sxm"), tp=1))


# -- hardware and transfer -----------------------------------------------------------------------------------
def test_hardware_presets() -> None:
    assert GPUS["a100-80g"].peak_flops == 312e12 and GPUS["a100-80g"].mem_bw == 2.04e12
    assert GPUS["h100-sxm"].peak_flops == 989e12 and GPUS["h100-sxm"].mem_bw == 3.35e12
    assert GPUS["h200"].peak_flops == 989e12 and GPUS["h200"].mem_bw == 4.8e12
    assert LINKS["nvlink"].bytes_per_s == 450e9  # one direction of 900 GB/s
    assert LINKS["rdma-400g"].bytes_per_s == 50e9
    assert LINKS["100gbe"].bytes_per_s == 12.5e9
    assert 60e9 <= LINKS["pcie5"].bytes_per_s <= 64e9
    g = custom_gpu(base=gpu_preset("h100-sxm"), mem_bw_tbs=4.0)
    assert g.mem_bw == 4e12 and g.peak_flops == 989e12
    assert custom_gpu("x", 100, 1, 24).mem_bytes == 24e9
    with pytest.raises(ValueError):
        custom_gpu("x", 100)


def test_transfer_of_a_4000_token_70b_prompt() -> None:
    nbytes = kv_bytes_per_request(LLAMA3_70B, 4000)
    assert nbytes == 1_310_720_000  # ~1.31 GB
    assert link_preset("rdma-400g").wire_s(nbytes) == pytest.approx(0.0262, abs=0.0005)  # ~26 ms
    assert link_preset("100gbe").wire_s(nbytes) == pytest.approx(0.1049, abs=0.0005)  # ~105 ms
    assert link_preset("nvlink").wire_s(nbytes) < 0.003  # under 3 ms
    rdma = link_preset("rdma-400g")
    assert transfer_s(LLAMA3_70B, rdma, 4000) == pytest.approx(rdma.setup_s + 0.0262144)


def test_layerwise_overlap_exposes_only_the_last_layer() -> None:
    wire, prefill = 0.0262144, 0.33
    assert exposed_transfer_s(wire, prefill, 80, setup_s=0.001, layerwise=False) == pytest.approx(0.0272144)
    # fast link: only the last layer's share (1/80) is on the critical path
    assert exposed_transfer_s(wire, prefill, 80, setup_s=0.001) == pytest.approx(0.001 + wire / 80)
    # link slower than the prefill: the transfer is the bottleneck and mostly exposed
    assert exposed_transfer_s(1.0, 0.4, 80) == pytest.approx(1.0 - 0.4 * 79 / 80)


# -- rates, share, sizing --------------------------------------------------------------------------------------
def test_prefill_share_hand_values() -> None:
    assert prefill_share(4, 12_000 / 800) == pytest.approx(4 / 19)
    assert prefill_share(4, 15) == pytest.approx(0.21, abs=0.005)  # chat: ~21%
    assert prefill_share(20, 15) == pytest.approx(0.57, abs=0.005)  # summarisation: ~57%
    assert prefill_share(1 / 6, 15) == pytest.approx(0.011, abs=0.001)  # reasoning: ~1%
    assert prefill_share(608 / 168, 15) == pytest.approx(0.194, abs=0.002)  # DeepSeek's disclosed ratio
    with pytest.raises(ValueError):
        prefill_share(1, 0)


def test_make_plan_with_exact_rates() -> None:
    plan = make_plan(
        LLAMA3_70B,
        FixedRates(),
        link_preset("rdma-400g"),
        4000,
        1000,
        target_rate=10,
        tpot_slo_s=0.05,
        budget_gpus=8,
    )
    assert plan.prefill_tokens_per_s == pytest.approx(12_000)
    assert plan.decode_tokens_per_s == pytest.approx(800)
    assert plan.decode_batch == 40  # step = B/800 <= 50 ms
    assert plan.rp_over_rd == pytest.approx(15)
    assert plan.r == 4 and plan.prefill_share == pytest.approx(4 / 19)
    assert plan.kv_bytes_per_request == 1_310_720_000
    # 10 req/s x 4000 tokens / (12000 x 0.8) = 4.17 -> 5; 10 x 1000 / (800 x 0.8) = 15.6 -> 16
    assert (plan.n_prefill, plan.n_decode) == (5, 16)
    # 8 GPUs: 1P7D sustains min(3, 5.6) = 3; 2P6D min(6, 4.8) = 4.8; 3P5D min(9, 4) = 4
    assert plan.budget_split == (2, 6) and plan.budget_max_rate == pytest.approx(4.8)
    assert best_split(8, 12_000, 800, 4000, 1000) == (2, 6, pytest.approx(4.8))
    assert instances_for(0, 4000, 12_000, 0.8) == 0
    d = plan.to_dict()
    assert d["prefill_share"] == pytest.approx(4 / 19) and json.dumps(d)


def test_break_even_prompt_length() -> None:
    wire_per_token = 327680 / 50e9
    # setup / (prefill per token - transfer per token): 1 ms / (83.3 us - 6.55 us) = 13.0 tokens
    assert break_even_prompt_tokens(0.001, 1 / 12_000, wire_per_token) == pytest.approx(13.03, abs=0.01)
    # layer-wise overlap hides all but 1/L of the wire time per token
    assert break_even_prompt_tokens(0.001, 1 / 12_000, wire_per_token, layers=80) == pytest.approx(
        0.001 / (1 / 12_000 - wire_per_token / 80)
    )
    # a 30 ms fixed cost (a slow control path) pushes it to a few hundred tokens
    assert 300 < break_even_prompt_tokens(0.03, 1 / 12_000, wire_per_token) < 500
    assert break_even_prompt_tokens(0.0, 1 / 12_000, wire_per_token) == 0.0
    assert math.isinf(
        break_even_prompt_tokens(0.001, 1e-6, 1e-5)
    )  # moving a token is dearer than computing it


def test_break_even_terms_and_the_degenerate_case(capsys: pytest.CaptureFixture[str]) -> None:
    """Each term printed and in the JSON; a link with no setup of its own still pays the engine's control round trips
    and the proxy's hop (``plan --link-gbs 50`` once printed a break-even of 0 tokens)."""
    terms = BreakEven.of(0.001, 0.0012, 0.002, 1 / 12_000, 327680 / 50e9, layers=80)
    assert terms.fixed_s == pytest.approx(0.0042)
    assert terms.exposed_s_per_token == pytest.approx(327680 / 50e9 / 80)
    assert terms.tokens == pytest.approx(0.0042 / (1 / 12_000 - 327680 / 50e9 / 80))
    argv = ["plan", "--model", "llama-3-70b", "--tp", "4", "--link-gbs", "50", "--prompt", "4000"]
    assert planner_main([*argv, "--json"]) == 0  # a custom bandwidth keeps --link's (rdma-400g's) setup cost
    assert json.loads(capsys.readouterr().out)["break_even_terms"]["link_setup_s"] == pytest.approx(0.001)
    argv += ["--link-setup-ms", "0"]
    assert planner_main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    t = d["break_even_terms"]
    assert t["link_setup_s"] == 0 and t["engine_fixed_s"] == MEASURED_ENGINE_FIXED_S
    assert t["proxy_hop_s"] == MEASURED_PROXY_HOP_S
    assert t["fixed_s"] == pytest.approx(MEASURED_ENGINE_FIXED_S + MEASURED_PROXY_HOP_S)
    assert d["break_even_prompt_tokens"] == pytest.approx(
        t["fixed_s"] / (t["prefill_s_per_token"] - t["exposed_s_per_token"])
    )
    assert d["break_even_prompt_tokens"] > 10
    # a fleet's own figures replace the defaults; zero everything and the old degenerate answer comes back
    assert planner_main([*argv, "--json", "--transfer-fixed-ms", "0", "--proxy-hop-ms", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["break_even_prompt_tokens"] == 0
    assert planner_main(argv) == 0
    text = capsys.readouterr().out
    assert "ms link setup +" in text and "ms transfer control +" in text and "ms proxy hop" in text
    assert "us prefill avoided" in text and "us transfer tail exposed" in text


def test_roofline_formulas() -> None:
    inst = InstanceSpec(gpu_preset("h100-sxm"), eff_compute=0.5, eff_mem=0.8, step_overhead_s=0.001)
    cost = RooflineCost(LLAMA3_8B, inst)
    # prefill of 4096 tokens: compute-bound, 2 x params x tokens + 4 x L x attn_dim x P^2/2
    flops = 2 * 8.03e9 * 4096 + 4 * 32 * 1024 * (4096 * 2048)
    assert cost.step_s(BatchShape.prefill(4096)) == pytest.approx(flops / (989e12 * 0.5) + 0.001)
    # decode of one sequence with no context: memory-bound, the weights (plus one token's KV) once
    step = (8.03e9 * 2 + 131072) / (3.35e12 * 0.8) + 0.001
    assert cost.step_s(BatchShape.decode(1, 0)) == pytest.approx(step)
    # decode of 64 x 2000-token sequences also reads their KV
    kv = 131072 * (64 * 2000 + 64)
    assert cost.step_s(BatchShape.decode(64, 2000)) == pytest.approx(
        (8.03e9 * 2 + kv) / (3.35e12 * 0.8) + 0.001
    )
    assert cost.kv_capacity_tokens == int(
        (81559 * 2**20 * 0.9 - 8.03e9 * 2) // 131072
    )  # nvidia-smi's 81,559 MiB
    tp2 = RooflineCost(LLAMA3_8B, InstanceSpec(gpu_preset("h100-sxm"), tp=2))
    assert tp2.step_s(BatchShape.prefill(4096)) < cost.step_s(BatchShape.prefill(4096))
    assert cost.step_s(BatchShape()) == 0.0


def test_decode_operating_point_meets_slo_and_memory() -> None:
    cost = RooflineCost(preset_model("llama-3-8b"), InstanceSpec(gpu_preset("h100-sxm")))
    dp = decode_rate(cost, 2048, 256, tpot_slo_s=0.02)
    assert dp.meets_slo and dp.step_s <= 0.02
    assert cost.step_s(BatchShape.decode(dp.batch + 1, 2048 + 128)) > 0.02
    loose = decode_rate(cost, 2048, 256, tpot_slo_s=1.0)
    assert loose.batch == cost.kv_capacity_tokens // (2048 + 256)  # memory caps it before the SLO does
    tight = decode_rate(cost, 2048, 256, tpot_slo_s=0.001)
    assert tight.batch == 1 and not tight.meets_slo
    # prefill is compute-bound and batches whole prompts: several times the decode rate per GPU
    assert prefill_rate(cost, 2048) > 3 * decode_rate(cost, 2048, 256, 0.05).tokens_per_s


def test_plan_from_profile() -> None:
    prof = Profile(
        prefill_tokens_per_s=12_000,
        decode_points=[DecodePoint(batch=1, step_s=0.01), DecodePoint(batch=40, step_s=0.05)],
        kv_capacity_tokens=10**7,
    )
    plan = make_plan(LLAMA3_70B, ProfileCost(prof), link_preset("rdma-400g"), 4000, 1000, tpot_slo_s=0.05)
    assert plan.decode_batch == 40 and plan.decode_tokens_per_s == pytest.approx(800)
    # prefill-only iteration = batch-1 step + tokens / rate: 4000 / (0.01 + 4000/12000)
    assert plan.prefill_tokens_per_s == pytest.approx(2 * 4000 / (0.01 + 8000 / 12_000))


# -- CLI -----------------------------------------------------------------------------------------------------
def test_cli_plan_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        planner_main(["plan", "--model", "llama-3-70b", "--tp", "4", "--prompt", "4000", "--output", "1000"])
        == 0
    )
    text = capsys.readouterr().out
    assert "327,680 B (320.0 KiB)" in text and "prefill share" in text and "1.31 GB" in text
    assert planner_main(["plan", "--json", "--rate", "5", "--gpus", "4", "--link", "100gbe"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 131072 and data["link"] == "100GbE"
    assert data["n_prefill"] >= 1 and data["budget_instances"] == 4
    assert (
        planner_main(
            [
                "plan",
                "--json",
                "--gpu",
                "mygpu",
                "--peak-tflops",
                "500",
                "--mem-bw-tbs",
                "2",
                "--mem-gb",
                "48",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["gpu"] == "mygpu"
    assert planner_main(["plan", "--model", "gpt-17"]) == 2
    assert "unknown model preset" in capsys.readouterr().err
    assert planner_main(["profile", "http://127.0.0.1:9", "--timeout", "2", "--out", "/dev/null"]) == 1


# -- profile: arithmetic -------------------------------------------------------------------------------------
def test_fit_prefill_recovers_rate_and_overhead() -> None:
    points = [PrefillPoint(prompt_tokens=p, seconds=0.005 + p / 20_000) for p in (128, 512, 2048)]
    rate, overhead = fit_prefill(points)
    assert rate == pytest.approx(20_000) and overhead == pytest.approx(0.005)
    assert fit_line([0, 1, 2], [1, 3, 5]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError):
        fit_prefill(
            [PrefillPoint(prompt_tokens=100, seconds=0.2), PrefillPoint(prompt_tokens=200, seconds=0.1)]
        )


def test_steady_state_gaps_use_only_the_full_batch_window() -> None:
    # stream A starts at 0 and steps every 10 ms; stream B joins at 0.05 and ends early at 0.15; while both run
    # the steps are 20 ms. Only gaps inside [0.05, 0.15] count.
    a = [0.00, 0.01, 0.02, 0.03, 0.04, 0.05, 0.07, 0.09, 0.11, 0.13, 0.15, 0.16, 0.17]
    b = [0.05, 0.07, 0.09, 0.11, 0.13, 0.15]
    gaps = steady_gaps([a, b])
    assert all(g == pytest.approx(0.02) for g in gaps) and len(gaps) == 10
    assert decode_step_from_streams([a, b]) == pytest.approx(0.02)
    assert decode_step_from_streams([[0.0, 0.1, 0.3]]) == pytest.approx(0.15)
    with pytest.raises(ValueError):
        decode_step_from_streams([[0.0]])


def test_profile_interpolation_and_roundtrip(tmp_path: Path) -> None:
    prof = Profile(
        prefill_tokens_per_s=10_000,
        decode_points=[DecodePoint(batch=1, step_s=0.01), DecodePoint(batch=9, step_s=0.02)],
    )
    assert prof.decode_step_s(1) == 0.01 and prof.decode_step_s(5) == pytest.approx(0.015)
    assert prof.decode_step_s(17) == pytest.approx(0.03)  # last slope beyond the last point
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    cost = ProfileCost(prof, kv_capacity_override=1000)
    assert cost.kv_capacity_tokens == 1000
    assert cost.step_s(BatchShape(prefill_tokens=1000, decode_seqs=5)) == pytest.approx(0.015 + 0.1)


def test_parse_kv_capacity_from_vllm_metrics() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048",prefix_caching="True"} 1.0\n'
    )
    assert parse_kv_capacity(text) == 32768
    assert parse_kv_capacity("vllm:num_requests_running 0\n") is None


# -- profile: against a fake OpenAI server ------------------------------------------------------------------
PREFILL_OVERHEAD_S = 0.003
PREFILL_S_PER_TOKEN = 20e-6  # 50,000 tokens/s
STEP_BASE_S, STEP_PER_SEQ_S = 0.004, 0.001


class _FakeVLLM(BaseHTTPRequestHandler):
    """Mimics /v1/models, /metrics and /v1/completions (non-streaming and SSE streaming) with known timings."""

    protocol_version = "HTTP/1.0"
    active = 0
    lock = threading.Lock()
    seen_prompts: list[list[int]] = []
    seen_auth: set[str | None] = set()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _json(self, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": "fake-llama"}]})
        elif self.path == "/metrics":
            text = b'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "fake-llama" and isinstance(body["prompt"], list)
        type(self).seen_prompts.append(body["prompt"])
        type(self).seen_auth.add(self.headers.get("Authorization"))
        if not body.get("stream"):
            steps = body.get("max_tokens", 1) - 1
            time.sleep(PREFILL_OVERHEAD_S + len(body["prompt"]) * PREFILL_S_PER_TOKEN + steps * STEP_BASE_S)
            self._json({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        with self.lock:
            type(self).active += 1
        try:
            for i in range(body["max_tokens"]):
                time.sleep(STEP_BASE_S + STEP_PER_SEQ_S * type(self).active)
                chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
        finally:
            with self.lock:
                type(self).active -= 1
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def fake_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLM)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_profile_against_fake_server(fake_server: str, tmp_path: Path) -> None:
    cfg = ProfileConfig(
        prompt_lens=(100, 800, 1600), repeats=2, batches=(1, 8), decode_tokens=12, api_key="sekrit"
    )
    out = tmp_path / "profile.json"
    prof = profile(fake_server, cfg=cfg, out=out)
    assert prof.model == "fake-llama" and prof.kv_capacity_tokens == 1600
    # What the profile measured, not how fast this machine was meanwhile (the fits' arithmetic is tested on
    # synthetic timings in test_profile_calibration and below): a latency is never shorter than the server's sleep for it.
    assert sorted({p.prompt_tokens for p in prof.prefill_points}) == [100, 800, 1600]
    for point in prof.prefill_points:
        assert point.seconds >= PREFILL_OVERHEAD_S + point.prompt_tokens * PREFILL_S_PER_TOKEN
    assert prof.prefill_tokens_per_s > 0
    steps = {p.batch: p.step_s for p in prof.decode_points}
    assert set(steps) == {1, 8} and all(step > 0 for step in steps.values())
    assert Profile.load(out) == prof
    # random token ids: no two prompts share a prefix the server could cache
    firsts = [tuple(p[:8]) for p in _FakeVLLM.seen_prompts]
    assert len(set(firsts)) == len(firsts)
    assert _FakeVLLM.seen_auth == {"Bearer sekrit"}


def test_latency_decode_points_reuse_their_prompts_so_the_prefix_cache_holds_them(
    fake_server: str, tmp_path: Path
) -> None:
    _FakeVLLM.seen_prompts = []
    cfg = ProfileConfig(prompt_lens=(100, 400), repeats=2, batches=(2,), decode_tokens=36, decode_prompt_tokens=64,
                        context_lens=(300,), context_batch=3, decode_method="latency")  # fmt: skip
    try:
        prof = profile(fake_server, cfg=cfg, out=tmp_path / "profile.json")
        uses: dict[tuple[int, ...], int] = {}
        for prompt in _FakeVLLM.seen_prompts:
            uses[tuple(prompt)] = uses.get(tuple(prompt), 0) + 1
    finally:
        _FakeVLLM.seen_prompts = []
    by_len: dict[int, list[int]] = {}
    for prompt, n in uses.items():
        by_len.setdefault(len(prompt), []).append(n)
    # prefill measurements: fresh prompts; each decode prompt: computed once, then both lengths in every round
    assert set(by_len[100]) == {1} and set(by_len[400]) == {1}
    assert sorted(by_len[64]) == [5, 5] and sorted(by_len[300]) == [5, 5, 5]
    assert [(p.batch, p.context_tokens) for p in prof.decode_points] == [(2, 64), (3, 300)]
    assert all(p.step_s > 0 for p in prof.decode_points)


def test_cli_profile_against_fake_server(
    fake_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    # lengths whose times differ by ~0.13 s, so a stalled request cannot turn the fitted slope negative
    argv = ["profile", fake_server, "--prompt-lens", "100,6400", "--batches", "2", "--repeats", "1"]
    assert planner_main([*argv, "--decode-tokens", "6", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "prefill:" in text and "decode batch    2" in text
    # each measured prompt length beside what the fit gives for it
    assert re.search(r"tokens: measured [0-9.]+ ms \(median\), fit [0-9.]+ ms", text), text
    assert Profile.load(out).decode_points[0].batch == 2


def test_add_subcommands_plugs_into_another_parser(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from vllm_disagg.planner.cli import add_subcommands

    parser = argparse.ArgumentParser(prog="vllm-disagg")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["plan", "--json", "--model", "qwen3-8b"])
    assert ns.func(ns) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 147456
    for cmd in ("simulate", "profile"):
        with pytest.raises(SystemExit):
            parser.parse_args([cmd, "--help"])


def test_planner_imports_without_vllm_torch_or_matplotlib() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('torch', 'vllm', 'transformers', 'matplotlib'):\n"
        "    sys.modules[m] = None\n"
        "import vllm_disagg.planner, vllm_disagg.planner.cli, vllm_disagg.planner.simulate\n"
        "import vllm_disagg.planner.profile, vllm_disagg.planner.plots\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_profile_summary_names_the_attention_term() -> None:
    from vllm_disagg.planner.cli import describe_prefill_fit, prefill_fit_s
    from vllm_disagg.planner.profiledata import DecodePoint

    prof = Profile(
        prefill_tokens_per_s=50_000.0,
        prefill_overhead_s=0.005,
        prefill_s_per_pair=2e-9,
        decode_points=[DecodePoint(batch=1, step_s=0.002)],
    )
    assert "attention 2 ns per query-key pair" in describe_prefill_fit(prof)
    assert prefill_fit_s(prof, 1000) == pytest.approx(0.005 + 0.02 + 2e-9 * 1000**2 / 2)
    assert "attention" not in describe_prefill_fit(prof.model_copy(update={"prefill_s_per_pair": 0.0}))


def test_the_break_even_length_does_not_depend_on_the_workloads_mean_prompt(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Its prefill avoided is priced at the break-even length itself: at a 32k mean prompt, attention once made every
    token look dearer and the break-even came out 38% short."""
    got = []
    for prompt in ("128", "2048", "32768"):
        argv = ["plan", "--model", "llama-3-8b", "--max-model-len", "131072", "--prompt", prompt, "--json"]
        assert planner_main(argv) == 0
        got.append(json.loads(capsys.readouterr().out)["break_even_prompt_tokens"])
    assert max(got) - min(got) < 2, got


def test_a_profile_brings_its_models_geometry(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --model, a profile of the tiny model is planned with the tiny model's KV bytes (once: Llama-3-8B's);
    a profile whose model cannot be read here says which preset stands in."""
    prof = json.loads(Path("docs/results/cpu-like-profile.json").read_text())
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**prof, "model": tiny_model}))
    assert planner_main(["plan", "--profile", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] != "llama-3-8b"
    path.write_text(json.dumps({**prof, "model": "somewhere-else"}))
    assert planner_main(["plan", "--profile", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "llama-3-8b" in out and "profile measured model 'somewhere-else'" in err


def test_a_slow_link_sizes_the_prefill_pool_and_caps_the_split(capsys: pytest.CaptureFixture[str]) -> None:
    """2,048 tokens of Llama-3-8B KV are 268 MB: at 2 GB/s a prefill instance's link carries 7.45 req/s at most,
    whatever its compute could prefill (the simulator's stability check counts the link the same way)."""
    argv = [
        "plan",
        "--json",
        "--link-gbs",
        "2",
        "--prompt",
        "2048",
        "--output",
        "256",
        "--rate",
        "8",
        "--gpus",
        "2",
    ]
    assert planner_main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    wire = 2048 * 131072 / 2e9
    assert data["prefill_bound"] == "link"
    assert data["n_prefill"] == math.ceil(8 * wire / 0.8)
    assert data["budget_max_rate"] == pytest.approx(1 / wire, rel=1e-6)
    fast = ["plan", "--json", "--link-gbs", "50", "--prompt", "2048", "--output", "256", "--rate", "8"]
    assert planner_main(fast) == 0
    assert json.loads(capsys.readouterr().out)["prefill_bound"] == "compute"


def test_plans_that_cannot_work_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        planner_main(
            [
                "plan",
                "--model",
                "llama-3-70b",
                "--tp",
                "2",
                "--prompt",
                "40000",
                "--output",
                "256",
                "--max-model-len",
                "131072",
            ]
        )  # fmt: skip
        == 0
    )
    text = capsys.readouterr().out
    assert "does not fit an instance's KV cache" in text and "KV cache/instance" in text
    assert planner_main(["plan", "--json", "--tpot-slo-ms", "0.5", "--rate", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any("TPOT SLO (0.5 ms" in w for w in data["warnings"])
    assert planner_main(["plan", "--model", "llama-3-70b", "--tp", "4", "--gpus", "6"]) == 0
    assert "a prefill/decode split needs 2" in capsys.readouterr().out
    assert planner_main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []


def test_bad_files_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    assert planner_main(["simulate", "--validate", str(listed)]) == 2
    assert "expected the results.json object" in capsys.readouterr().err
    config = tmp_path / "config.json"
    config.write_text('{"hidden_size": 4096}')
    assert planner_main(["plan", "--hf-config", str(config)]) == 2
    assert "lacks num_hidden_layers" in capsys.readouterr().err


def test_the_decode_line_says_what_capped_its_batch(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, bound in (
        (["--model", "llama-3-70b", "--tp", "4"], "KV memory"),
        (["--tpot-slo-ms", "15"], "the TPOT SLO"),
        (["--max-num-seqs", "8"], "max_num_seqs"),
    ):
        assert planner_main(["plan", "--json", *argv]) == 0
        assert json.loads(capsys.readouterr().out)["decode_bound"] == bound, argv


def test_kv_cache_of_8_bit_weights_is_bf16_unless_told() -> None:
    """vLLM's ``--kv-cache-dtype auto`` keeps the cache in the activations' type: FP8 weights do not halve the KV."""
    fp8_weights = preset_model("llama-3-70b", dtype="fp8")
    assert fp8_weights.weight_dtype_bytes == 1
    assert fp8_weights.kv_bytes_per_token == 327680
    assert fp8_weights.with_overrides(kv_dtype="fp8").kv_bytes_per_token == 163840
    assert preset_model("llama-3-8b", dtype="float32").kv_bytes_per_token == 2 * 131072


def test_kv_copies_under_tensor_parallelism() -> None:
    """Ranks beyond the KV heads replicate them, and every rank holds MLA's whole latent: what the instance stores,
    reads per decode step and ships."""
    l70 = preset_model("llama-3-70b")  # 8 KV heads
    assert l70.at_tp(8).kv_bytes_per_token == 327680
    assert l70.at_tp(16).kv_copies == 2 and l70.at_tp(16).kv_bytes_per_token == 2 * 327680
    ds = preset_model("deepseek-v3", dtype="fp8")
    assert ds.at_tp(8).kv_bytes_per_token == 8 * 70272
    with pytest.raises(ValueError, match="3 ranks"):
        l70.at_tp(3)
    with pytest.raises(ValueError, match="12 ranks"):
        l70.at_tp(12)


def test_plan_prices_replicated_kv(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        planner_main(
            ["plan", "--model", "deepseek-v3", "--dtype", "fp8", "--gpu", "h200", "--tp", "8", "--json"]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_copies"] == 8 and plan["kv_bytes_per_token"] == 8 * 70272
    assert (
        planner_main(["plan", "--model", "deepseek-v3", "--dtype", "fp8", "--gpu", "h200", "--tp", "8"]) == 0
    )
    assert "8 copies over the 8 ranks" in capsys.readouterr().out


def test_params_sets_the_total_and_an_moe_keeps_its_active_count(capsys: pytest.CaptureFixture[str]) -> None:
    """``--params`` with DeepSeek-V3's own total once made it dense (active 37.55B -> 671B, prefill 17x slower)."""
    ds = preset_model("deepseek-v3", dtype="fp8")
    same = ds.with_params(ds.params)
    assert same.active == ds.active and same.expert_params == ds.expert_params
    bigger = ds.with_params(ds.params + 100e9)
    assert (
        bigger.active == pytest.approx(37.55e9, rel=1e-3) and bigger.weight_bytes == ds.weight_bytes + 100e9
    )
    assert bigger.expert_params == ds.expert_params + 100e9  # the experts hold the difference
    assert ds.with_params(active=20e9).active == 20e9
    with pytest.raises(ValueError, match="exceed"):
        ds.with_params(30e9)  # fewer in total than one token uses
    dense = preset_model("llama-3-8b").with_params(9e9)
    assert dense.params == dense.active == 9e9
    argv = ["plan", "--model", "deepseek-v3", "--dtype", "fp8", "--gpu", "h200", "--tp", "8", "--json"]
    assert planner_main(argv) == 0
    base = json.loads(capsys.readouterr().out)
    assert planner_main([*argv, "--params", f"{ds.params!r}"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["prefill_tokens_per_s"] == pytest.approx(base["prefill_tokens_per_s"])
    assert again["decode_tokens_per_s"] == pytest.approx(base["decode_tokens_per_s"])


def test_tp_must_divide_the_query_heads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM refuses a --tp that does not divide the attention heads; the planner once priced Qwen2.5-7B (28 heads,
    4 KV heads) at --tp 8 and Llama-3-8B (32 heads) at --tp 64."""
    cfg = {
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    qwen = ModelSpec.from_hf_config_file(tmp_path, name="qwen2.5-7b")
    assert qwen.num_heads == 28 and qwen.valid_tps() == [1, 2, 4, 28]
    with pytest.raises(ValueError, match=r"28 attention heads do not split over 8 ranks.*valid: 1, 2, 4, 28"):
        qwen.at_tp(8)
    assert preset_model("llama-3-8b").valid_tps() == [1, 2, 4, 8, 16, 32]
    assert planner_main(["plan", "--model", "llama-3-8b", "--tp", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'llama-3-8b': 32 attention heads do not split over 64 ranks" in err
    assert planner_main(["plan", "--hf-config", str(tmp_path), "--tp", "8"]) == 2
    assert "valid: 1, 2, 4, 28" in capsys.readouterr().err


def test_prompts_past_the_context_window_are_refused_or_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Llama-3-8B's context is 8,192 tokens: a 200k-token prompt was once planned and simulated as if it fit."""
    assert {n: preset_model(n).max_model_len for n in PRESET_CONFIGS} == {
        "llama-3-8b": 8192,
        "llama-3-70b": 8192,
        "qwen3-8b": 40960,
        "deepseek-v3": 163840,
    }
    assert (
        ModelSpec.from_hf_config(
            {**PRESET_CONFIGS["llama-3-8b"], "max_position_embeddings": 32768}
        ).max_model_len
        == 32768
    )
    yarn = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert ModelSpec.from_hf_config({**PRESET_CONFIGS["llama-3-8b"], **yarn}).max_model_len == 131072
    assert planner_main(["plan", "--model", "llama-3-8b", "--prompt", "200000", "--output", "256"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "200,000-token prompt is longer than llama-3-8b's context window of 8,192" in err
    )
    assert planner_main(["plan", "--json", "--prompt", "8000", "--output", "256"]) == 0
    assert any(
        "runs past llama-3-8b's context window" in w for w in json.loads(capsys.readouterr().out)["warnings"]
    )
    assert (
        planner_main(["plan", "--prompt", "20000", "--max-model-len", "32768"]) == 0
    )  # a deployment's own window
    capsys.readouterr()
    sim = ["simulate", "--model", "llama-3-8b", "--output", "64", "--rates", "0.05", "--requests", "20"]
    assert planner_main([*sim, "--prompt", "100000"]) == 2
    assert (
        "--prompt '100000' reaches 100,000 tokens, past llama-3-8b's context window"
        in capsys.readouterr().err
    )
    assert planner_main([*sim, "--prompt", "lognormal:2048:0.5:16:9000"]) == 2
    assert "reaches 9,000 tokens" in capsys.readouterr().err
    assert planner_main([*sim, "--prompt", "8000", "--prefixes", "2", "--prefix-tokens", "1024"]) == 2
    assert "with the 1,024-token shared prefix" in capsys.readouterr().err
    assert planner_main([*sim, "--prompt", "exp:6000", "--json"]) == 0  # unbounded: what was drawn is flagged
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert any(
        "prompts of --prompt 'exp:6000' are longer than llama-3-8b's context window" in w for w in warnings
    )
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 9000, "output_tokens": 4}\n')
    assert planner_main(["simulate", "--trace", str(trace), "--requests", "1"]) == 0
    assert "1 of 1 prompts of trace" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            '"prefill_tokens_per_s": 0, "decode_points": [{"batch": 1, "step_s": 0.005}]',
            "prefill_tokens_per_s:",
        ),
        (
            '"prefill_tokens_per_s": 4500, "decode_points": [{"batch": 1, "step_s": -0.005}]',
            "decode_points.0.step_s: input should be greater than 0, got -0.005",
        ),
        ('"prefill_tokens_per_s": 4500, "decode_points": []', "decode_points:"),
        ('"tp": 0, "prefill_tokens_per_s": 4500, "decode_points": [{"batch": 1, "step_s": 0.005}]', "tp:"),
        (
            '"prefill_tokens_per_s": 4500, "decode_points": [{"batch": 1, "step_s": 0.005}], "kv_capacity_tokens": 0',
            "kv_capacity_tokens:",
        ),
    ],
)
def test_a_hand_written_profile_is_checked_on_load(
    body: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A zero rate once ended in a ZeroDivisionError traceback, a negative step in a negative TPOT and 100% in SLO."""
    path = tmp_path / "p.json"
    path.write_text("{" + body + "}")
    for argv in (["plan"], ["simulate", "--requests", "20", "--rates", "1"]):
        assert planner_main([*argv, "--profile", str(path), "--model", "llama-3-8b"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"profile {path}: {message}" in err, err
    path.write_text("hello")
    with pytest.raises(ValueError, match="not JSON"):
        Profile.load(path)


def test_tp_may_not_contradict_the_profile(capsys: pytest.CaptureFixture[str]) -> None:
    """The profile's rates are its instance's: --tp 4 with a 1-GPU profile was once ignored without a word."""
    prof = str(Path(__file__).parents[2] / "docs/results/cpu-like-profile.json")
    argv = [
        "plan",
        "--profile",
        prof,
        "--model",
        "llama-3-8b",
        "--prompt",
        "1500",
        "--output",
        "16",
        "--gpus",
        "8",
    ]
    assert planner_main([*argv, "--tp", "4"]) == 2
    assert "--tp 4 contradicts the profile" in capsys.readouterr().err
    assert planner_main([*argv, "--tp", "1"]) == 0  # the profile's own size is fine
    assert "8 GPUs" in capsys.readouterr().out


def test_the_break_even_finds_the_crossing_on_a_slow_link(capsys: pytest.CaptureFixture[str]) -> None:
    """At 2.2 GB/s a transfer's exposed tail outweighs the prefill it saves at short prompts but not at long ones
    (attention makes their tokens dearer and hides more of the wire): the plan once said "never" there, and "1 token"
    for a 10M-token workload, from a fixed point started at the workload's prompt."""
    base = ["plan", "--json", "--max-model-len", "20000000", "--output", "256"]
    assert planner_main([*base, "--link-gbs", "2.2", "--prompt", "32768"]) == 0
    d = json.loads(capsys.readouterr().out)
    p_star, t = d["break_even_prompt_tokens"], d["break_even_terms"]
    assert p_star is not None and 1000 < p_star < 32768
    assert (
        t["at_tokens"] * (t["prefill_s_per_token"] - t["exposed_s_per_token"]) >= t["fixed_s"]
    )  # wins there
    assert planner_main([*base, "--link-gbs", "2.2", "--prompt", str(t["at_tokens"] - 1)]) == 0
    below = json.loads(capsys.readouterr().out)["break_even_terms"]
    assert below["at_tokens"] == t["at_tokens"]  # the same crossing from any workload length
    got = []
    for prompt in ("2048", "10000000"):
        assert planner_main([*base, "--prompt", prompt, "--output", "10"]) == 0
        got.append(json.loads(capsys.readouterr().out)["break_even_prompt_tokens"])
    assert 140 < got[0] < 160 and abs(got[1] - got[0]) < 2, got
    # a link so slow that no prompt in the context window pays: said so, with the window searched
    assert planner_main(["plan", "--link-gbs", "0.05", "--prompt", "2048"]) == 0
    assert "never up to 8,192 tokens" in capsys.readouterr().out
