"""``plan``, ``simulate`` and ``profile`` subcommands; ``add_subcommands`` plugs them into any argparse CLI.

matplotlib (plots) and httpx (profile) are imported only by the subcommands that use them.

Run standalone with ``python -m vllm_disagg.planner.cli {plan,simulate,profile} ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from vllm_disagg.planner.costmodel import ProfileCost, RooflineCost, StepModel
from vllm_disagg.planner.engine import EngineConfig
from vllm_disagg.planner.hardware import (
    MEASURED_ENGINE_FIXED_S,
    MEASURED_PROXY_HOP_S,
    InstanceSpec,
    Link,
    custom_gpu,
    gpu_preset,
    link_preset,
)
from vllm_disagg.planner.metrics import Summary
from vllm_disagg.planner.model import PRESET_CONFIGS, ModelSpec, preset_model
from vllm_disagg.planner.plan import make_plan
from vllm_disagg.planner.profiledata import Profile
from vllm_disagg.planner.report import format_goodput, format_plan, format_sim_table, winners
from vllm_disagg.planner.routing import ROUTINGS
from vllm_disagg.planner.simulate import Adaptive, Colocated, Design, Disaggregated, goodput, simulate_rate
from vllm_disagg.planner.stability import Stability
from vllm_disagg.planner.workload import LengthDist, Workload, load_trace, requests_for_duration, synthetic
from vllm_disagg.policy.cost_model import CostModelConfig
from vllm_disagg.policy.loader import parse_policy_args, policy_builder

# The SLOs the proxy's cost model serves by default: the planner sizes and scores against the same ones.
DEFAULT_SLOS = CostModelConfig()


DEFAULT_PROMPT_MAX = (
    8192  # the longest prompt of the default --prompt (less on a model with a shorter context)
)


def _csv(kind: Any) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r} lists no values; give one or more, comma-separated")
        return values

    return parse


def _bounded(kind: type, low: float, *, above: bool = False, high: float | None = None) -> Any:
    """An argparse type: a finite ``kind`` at least ``low`` (above it, with ``above``) and at most ``high``."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {'number' if kind is float else 'whole number'}"
            ) from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if v < low or (above and v == low):
            raise argparse.ArgumentTypeError(f"{text} must be {'above' if above else 'at least'} {low:g}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(
                f"{text} must be at most {high:,}" if kind is int else f"{text} must be at most {high:g}"
            )
        return v

    parse.__name__ = kind.__name__
    return parse


_POSITIVE = _bounded(float, 0, above=True)  # bandwidths, rates, SLOs, sizes
_NONNEGATIVE = _bounded(float, 0)  # fixed costs, warm-up
_SHARE = _bounded(float, 0, above=True, high=1)  # efficiencies, utilisation caps
_COUNT = _bounded(int, 1)  # instances, tokens, GPUs, requests


# The most requests one simulated rate may hold: a sample and its records cost about 1 KB a request in memory, and
# a million of them take minutes to simulate.
MAX_REQUESTS = 1_000_000


# -- shared options -------------------------------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        help=f"preset: {', '.join(PRESET_CONFIGS)} (default: the --profile's model where its config is readable "
        "here, else llama-3-8b)",
    )
    g.add_argument("--hf-config", help="an HF config.json (or its directory); overrides --model")
    g.add_argument("--layers", type=_COUNT)
    g.add_argument("--kv-heads", type=_COUNT)
    g.add_argument("--head-dim", type=_COUNT)
    g.add_argument(
        "--params",
        type=_POSITIVE,
        help="total parameters, e.g. 8e9 (weight memory). An MoE keeps its active count (FLOPs per token); the "
        "change goes to its routed experts. A dense model's active count is its total",
    )
    g.add_argument(
        "--active-params", type=_POSITIVE, help="parameters one token multiplies through (MoE), e.g. 37e9"
    )
    g.add_argument("--dtype", help="weight dtype (default: the config's)")
    g.add_argument(
        "--kv-dtype",
        help="KV-cache dtype when it differs, e.g. fp8 (vLLM's --kv-cache-dtype names, auto included)",
    )
    g.add_argument(
        "--mla-latent", type=_COUNT, help="MLA latent size per layer (kv_lora_rank + qk_rope_head_dim)"
    )
    g.add_argument(
        "--max-model-len",
        type=_COUNT,
        help="context window in tokens, vLLM's --max-model-len (default: the config's max_position_embeddings); "
        "longer prompts are refused",
    )


def _add_hw_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hardware")
    g.add_argument("--gpu", default="h100-sxm", help="a100-80g, h100-sxm, h200 (edit with the three below)")
    g.add_argument("--peak-tflops", type=_POSITIVE, help="dense BF16 TFLOP/s (custom GPU)")
    g.add_argument("--mem-bw-tbs", type=_POSITIVE, help="HBM TB/s (custom GPU)")
    g.add_argument(
        "--mem-gb",
        type=_POSITIVE,
        help="GPU memory in GB of 1e9 bytes (custom GPU; nvidia-smi reports MiB: 81,559 MiB is 85.5 GB)",
    )
    g.add_argument(
        "--tp",
        type=_COUNT,
        help="GPUs per instance (tensor parallel; default 1, or the --profile's own, which --tp may not contradict)",
    )
    g.add_argument("--eff-compute", type=_SHARE, default=0.5, help="achieved share of peak FLOP/s")
    g.add_argument("--eff-mem", type=_SHARE, default=0.8, help="achieved share of HBM bandwidth")
    g.add_argument("--step-overhead-ms", type=_NONNEGATIVE, default=1.0, help="per-iteration overhead")
    g.add_argument("--gpu-mem-util", type=_SHARE, default=0.9)
    g.add_argument("--link", default="rdma-400g", help="nvlink, pcie5, rdma-400g, 100gbe")
    g.add_argument("--link-gbs", type=_POSITIVE, help="custom link bandwidth, GB/s")
    g.add_argument("--link-setup-ms", type=_NONNEGATIVE, help="fixed cost per transfer, ms")
    g.add_argument("--no-layerwise", action="store_true", help="transfer only after the whole prefill")
    g.add_argument(
        "--transfer-fixed-ms",
        type=_NONNEGATIVE,
        default=MEASURED_ENGINE_FIXED_S * 1e3,
        help="the transfer engine's control round trips per transfer, beside the link's setup (default: measured "
        "by benchmarks/transport.py on loopback)",
    )
    g.add_argument(
        "--proxy-hop-ms",
        type=_NONNEGATIVE,
        default=MEASURED_PROXY_HOP_S * 1e3,
        help="the proxy's extra hop on a transfer plan (default: measured by benchmarks/proxy.py)",
    )
    g.add_argument("--profile", help="a JSON profile (from `profile`) replacing the roofline rates")
    e = p.add_argument_group("engine and output")
    e.add_argument(
        "--kv-capacity-tokens", type=_COUNT, help="KV tokens per instance (default: from memory/profile)"
    )
    e.add_argument("--max-num-seqs", type=_COUNT, default=256, help="vLLM's --max-num-seqs")
    e.add_argument("--max-batched-tokens", type=_COUNT, default=8192, help="vLLM's --max-num-batched-tokens")
    e.add_argument(
        "--tpot-slo-ms",
        type=_POSITIVE,
        default=DEFAULT_SLOS.tpot_slo_s * 1e3,
        help="TPOT SLO (caps the decode batch in plan; default: the proxy's --tpot-slo-s)",
    )
    e.add_argument("--json", action="store_true", help="machine-readable output")


def build_model(ns: argparse.Namespace) -> ModelSpec:
    hf_config, preset = ns.hf_config, ns.model
    if not hf_config and not preset:
        hf_config, preset = _profiled_model(ns)
    if hf_config:
        model = ModelSpec.from_hf_config_file(hf_config, dtype=ns.dtype)
    else:
        model = preset_model(preset or "llama-3-8b", dtype=ns.dtype)
    return model.with_overrides(
        num_layers=ns.layers,
        num_kv_heads=ns.kv_heads,
        head_dim=ns.head_dim,
        kv_dtype=None if ns.kv_dtype == "auto" else ns.kv_dtype,
        mla_latent_dim=ns.mla_latent,
        max_model_len=ns.max_model_len,
    ).with_params(ns.params, ns.active_params)


def _profiled_model(ns: argparse.Namespace) -> tuple[str | None, str]:
    """(config path, preset) of the model whose geometry (KV bytes per token, layers) goes with the numbers when
    no --model is given: a profile's own where it names a directory with a config.json here, else the llama-3-8b
    preset, said aloud."""
    profile = getattr(ns, "profile", None)
    if profile:
        name = Profile.load(profile).model
        if name and (Path(name) / "config.json").is_file():
            return name, ""
        print(
            f"note: the profile measured model {name or '(unnamed)'!r}; its geometry is taken from the llama-3-8b "
            "preset: pass --model or --hf-config for its KV bytes per token",
            file=sys.stderr,
        )
    return None, "llama-3-8b"


def build_instance(ns: argparse.Namespace) -> InstanceSpec:
    try:
        base = gpu_preset(ns.gpu)
    except ValueError:
        base = None
        if ns.peak_tflops is None:
            raise
    gpu = custom_gpu(ns.gpu, ns.peak_tflops, ns.mem_bw_tbs, ns.mem_gb, base=base)
    return InstanceSpec(
        gpu=gpu,
        tp=ns.tp or 1,
        eff_compute=ns.eff_compute,
        eff_mem=ns.eff_mem,
        step_overhead_s=ns.step_overhead_ms / 1e3,
        gpu_mem_util=ns.gpu_mem_util,
    )


def build_link(ns: argparse.Namespace) -> Link:
    link = link_preset(ns.link)
    if (
        ns.link_gbs is not None
    ):  # a custom bandwidth keeps --link's fixed cost unless --link-setup-ms says otherwise
        setup = link.setup_s if ns.link_setup_ms is None else ns.link_setup_ms / 1e3
        return Link(f"custom-{ns.link_gbs:g}GB/s", ns.link_gbs * 1e9, setup)
    if ns.link_setup_ms is not None:
        link = Link(link.name, link.bytes_per_s, ns.link_setup_ms / 1e3)
    return link


def build_cost(ns: argparse.Namespace, model: ModelSpec) -> tuple[StepModel, str, int, str, ModelSpec]:
    """(cost model, source label, GPUs per instance, GPU label, the model as an instance of that many GPUs stores
    its KV)."""
    if ns.profile:
        prof = Profile.load(ns.profile).refitted()
        if ns.tp is not None and ns.tp != prof.tp:
            raise ValueError(
                f"--tp {ns.tp} contradicts the profile {ns.profile}, measured on an instance of {prof.tp} GPU(s): its "
                "rates are that instance's; drop --tp, or profile an instance of the size you mean"
            )
        return (
            ProfileCost(prof, ns.kv_capacity_tokens),
            f"profile {ns.profile}",
            prof.tp,
            prof.model or "measured",
            model.at_tp(prof.tp),
        )
    inst = build_instance(ns)
    model = model.at_tp(inst.tp)
    return RooflineCost(model, inst, ns.kv_capacity_tokens), "roofline", inst.tp, inst.gpu.name, model


def _user_errors(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Bad input (unknown preset, malformed spec, unreadable file) is a one-line message and exit code 2."""

    def wrapped(ns: argparse.Namespace) -> int:
        try:
            return handler(ns)
        except BrokenPipeError:  # `vllm-disagg plan | head`: the reader is gone, nothing went wrong here
            sys.stderr.close()
            return 0
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


def _emit(ns: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2) if ns.json else text)


# -- plan -----------------------------------------------------------------------------------------------------
@_user_errors
def cmd_plan(ns: argparse.Namespace) -> int:
    cost, source, tp, gpu_name, model = build_cost(ns, build_model(ns))
    plan = make_plan(
        model,
        cost,
        build_link(ns),
        ns.prompt,
        ns.output,
        tp=tp,
        gpu_name=gpu_name,
        source=source,
        tpot_slo_s=ns.tpot_slo_ms / 1e3,
        target_rate=ns.rate,
        max_util=ns.max_util,
        max_batched_tokens=ns.max_batched_tokens,
        max_num_seqs=ns.max_num_seqs,
        budget_gpus=ns.gpus,
        layerwise=not ns.no_layerwise,
        engine_fixed_s=ns.transfer_fixed_ms / 1e3,
        proxy_hop_s=ns.proxy_hop_ms / 1e3,
    )
    _emit(ns, plan.to_dict(), format_plan(plan))
    return 0


# -- simulate -------------------------------------------------------------------------------------------------
@_user_errors
def cmd_simulate(ns: argparse.Namespace) -> int:
    if ns.validate:
        return _validate(ns)
    if ns.policy_args is not None and not ns.policy:
        raise ValueError(
            "--policy-args are the --policy's constructor arguments: give --policy too, or drop them"
        )
    cost, cost_source, tp, gpu_name, model = build_cost(ns, build_model(ns))
    if ns.warmup < 0 or (ns.duration is not None and ns.duration <= ns.warmup):
        raise ValueError("--warmup must be >= 0 and shorter than --duration")
    if ns.prompt is None:  # the default workload, kept inside the model's context window
        context = model.max_model_len or DEFAULT_PROMPT_MAX
        ns.prompt = f"lognormal:{min(2048, context // 2)}:0.5:16:{min(DEFAULT_PROMPT_MAX, context)}"
    prompt, output = _length(ns.prompt, "--prompt"), _length(ns.output, "--output")
    if not ns.trace:
        _check_prompt_spec(ns, prompt, model)

    def sample(n: int) -> Workload:
        if n > MAX_REQUESTS:
            raise ValueError(
                f"{n:,} requests at one rate (--duration's arrivals at that rate, or --requests plus the --warmup's) "
                f"are over the simulator's limit of {MAX_REQUESTS:,}: shorten --duration or --warmup, or lower the rate"
            )
        return synthetic(
            n,
            prompt,
            output,
            arrival=ns.arrival,
            burstiness=ns.burstiness,
            seed=ns.seed,
            num_prefixes=ns.prefixes,
            prefix_tokens=ns.prefix_tokens,
        )

    def sample_at(rate: float) -> Workload:
        """Goodput probes: --duration's worth of arrivals at that rate, or --requests after the warm-up."""
        if ns.duration is not None:
            return sample(requests_for_duration(ns.duration, rate))
        return sample(ns.requests + (requests_for_duration(ns.warmup, rate) if ns.warmup > 0 else 0))

    if ns.trace:
        workload = load_trace(ns.trace)
    else:
        n = ns.requests
        if ns.duration is not None:
            n = requests_for_duration(ns.duration, max(ns.rates or (1.0,)))
        workload = sample(n)
    rates = ns.rates or ((workload.native_rate,) if ns.trace else (1.0,))
    short = [r for r in rates if ns.duration is not None and not workload.covers(r, ns.duration)]
    notes = [
        f"warning: at {r:g} req/s the {'trace' if ns.trace else 'sample'}'s arrivals end before --duration "
        f"{ns.duration:g} s: that row covers less time than asked"
        + (" (use a longer trace or a lower rate)" if ns.trace else " (another --seed)")
        for r in short
    ]
    notes += _context_notes(ns, workload, model)
    engine = EngineConfig(
        max_num_seqs=ns.max_num_seqs,
        max_batched_tokens=ns.max_batched_tokens,
        chunked_prefill=ns.chunked_prefill,
        kv_capacity_tokens=ns.kv_capacity_tokens,
    )
    designs: list[Design] = []
    if ns.design in ("both", "colocated", "all"):
        designs.append(Colocated(ns.replicas or ns.prefill + ns.decode, ns.colocated_routing))
    ttft_slo, tpot_slo = ns.ttft_slo_ms / 1e3, ns.tpot_slo_ms / 1e3
    if ns.design in ("both", "disagg", "all"):
        policy = _policy(ns, ttft_slo, tpot_slo, model, build_link(ns)) if ns.policy else None
        designs.append(
            Disaggregated(
                ns.prefill,
                ns.decode,
                build_link(ns),
                not ns.no_layerwise,
                policy,
                ns.prefill_routing,
                ns.decode_routing,
                (ns.transfer_fixed_ms + ns.proxy_hop_ms) / 1e3,
            )
        )
    if ns.design in ("adaptive", "all"):
        designs.append(
            Adaptive(
                ns.replicas or ns.prefill + ns.decode,
                build_link(ns),
                _policy(ns, ttft_slo, tpot_slo, model, build_link(ns)) if ns.policy else None,
                not ns.no_layerwise,
                (ns.transfer_fixed_ms + ns.proxy_hop_ms) / 1e3,
                ttft_slo,
                tpot_slo,
            )
        )
    run = {"engine": engine, "seed": ns.seed, "duration_s": ns.duration}
    rows = []
    failures: list[str] = []
    # With a warm-up, each rate gets --requests after its own warm-up's arrivals, as the goodput probes do.
    per_rate = not ns.trace and ns.duration is None and ns.warmup > 0
    for design in designs:
        for rate in rates:
            res = simulate_rate(sample_at(rate) if per_rate else workload, rate, design, model, cost, **run)
            summary = res.summary(ttft_slo, tpot_slo, ns.warmup)
            if summary.requests == 0:
                raise ValueError(
                    f"at {rate:g} req/s every request arrives within the {ns.warmup:g} s warm-up: use more "
                    "requests, a longer --duration or a shorter --warmup"
                )
            rows.append((design.name, rate, summary, res.stability))
            if res.policy_failures:
                failures.append(
                    f"warning: {design.name} at {rate:g} req/s: the policy's plan was replaced by least-loaded's for "
                    f"{res.policy_failures} request(s), as the proxy would (first: {res.policy_first_failure})"
                )
    failures = [*notes, *failures]
    text = [format_sim_table(rows), *failures]
    if len(designs) > 1:
        text.extend(winners(rows))
    data: dict[str, Any] = {
        "inputs": _sim_inputs(ns, model, cost_source, gpu_name, tp, engine),
        "results": [{"design": d, "rate": r, **st.to_dict(), "summary": s.to_dict()} for d, r, s, st in rows],
        "goodput": {},
        "warnings": failures,
    }
    if ns.goodput:
        for design in designs:
            g = goodput(
                workload,
                design,
                model,
                cost,
                ttft_slo,
                tpot_slo,
                start_rate=max(rates),
                warmup_s=ns.warmup,
                workload_at=None if ns.trace else sample_at,
                **run,
            )
            data["goodput"][design.name] = {
                "rate": g.rate,
                "target": g.target,
                "probes": g.probes,
                "unstable_probes": g.unstable,
            }
            text.append(format_goodput(design.name, g))
    if ns.plot_dir:
        text.extend(_plots(ns, workload, designs, rows, model, cost, engine))
    _emit(ns, data, "\n".join(text))
    return 0


def _sim_inputs(
    ns: argparse.Namespace, model: ModelSpec, source: str, gpu: str, tp: int, engine: EngineConfig
) -> dict[str, Any]:
    """What produced a simulate --json result, so that a saved one can be traced back and rerun."""
    link = build_link(ns)
    return {
        "model": model.name,
        "dtype": model.dtype,
        "kv_dtype": model.kv_dtype,
        "rates_from": source,
        "gpu": gpu,
        "tp": tp,
        "link": {"name": link.name, "bytes_per_s": link.bytes_per_s, "setup_s": link.setup_s},
        "layerwise": not ns.no_layerwise,
        "transfer_fixed_s": ns.transfer_fixed_ms / 1e3,
        "proxy_hop_s": ns.proxy_hop_ms / 1e3,
        "workload": {
            "trace": ns.trace,
            "prompt": None if ns.trace else ns.prompt,
            "output": None if ns.trace else ns.output,
            "arrival": ns.arrival,
            "burstiness": ns.burstiness,
            "prefixes": ns.prefixes,
            "prefix_tokens": ns.prefix_tokens,
            "requests": ns.requests,
            "duration_s": ns.duration,
            "warmup_s": ns.warmup,
            "seed": ns.seed,
        },
        "design": ns.design,
        "replicas": ns.replicas or ns.prefill + ns.decode,
        "prefill": ns.prefill,
        "decode": ns.decode,
        "routing": {
            "colocated": ns.colocated_routing,
            "prefill": ns.prefill_routing,
            "decode": ns.decode_routing,
        },
        "policy": ns.policy,
        "policy_args": ns.policy_args,
        "engine": dataclasses.asdict(engine),
        "ttft_slo_s": ns.ttft_slo_ms / 1e3,
        "tpot_slo_s": ns.tpot_slo_ms / 1e3,
    }


def _length(spec: str, option: str) -> LengthDist:
    try:
        return LengthDist.parse(spec)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def _check_prompt_spec(ns: argparse.Namespace, prompt: LengthDist, model: ModelSpec) -> None:
    """Refuse a --prompt whose stated maximum (with the shared prefix) is past the model's context window."""
    context = model.max_model_len
    longest = prompt.upper + (ns.prefix_tokens if ns.prefixes else 0)
    if context and math.isfinite(longest) and longest > context:
        prefix = f" with the {ns.prefix_tokens:,}-token shared prefix" if ns.prefixes else ""
        raise ValueError(
            f"--prompt {ns.prompt!r} reaches {longest:,.0f} tokens{prefix}, past {model.name}'s context window of "
            f"{context:,} tokens (its max_position_embeddings): vLLM refuses such prompts; lower the prompt's "
            "maximum, or give --max-model-len where the deployment runs a longer context"
        )


def _context_notes(ns: argparse.Namespace, workload: Workload, model: ModelSpec) -> list[str]:
    """A warning when drawn (unbounded --prompt) or traced prompts run past the model's context window."""
    context = model.max_model_len
    over = sum(p > context for p in workload.prompts) if context else 0
    if not over:
        return []
    source = f"trace {ns.trace}" if ns.trace else f"--prompt {ns.prompt!r}"
    fix = "" if ns.trace else "; give the spec a MAX (e.g. exp:MEAN:1:MAX) to keep them inside"
    return [
        f"warning: {over} of {len(workload)} prompts of {source} are longer than {model.name}'s context window "
        f"of {context:,} tokens (longest {max(workload.prompts):,}): vLLM would refuse them, the simulation "
        f"serves them{fix}"
    ]


def _policy(
    ns: argparse.Namespace, ttft_slo_s: float, tpot_slo_s: float, model: ModelSpec, link: Link
) -> Callable[[], Any]:
    """What builds the policy ``--policy`` names (with ``--policy-args``), once per run (checked now); the cost
    model, or a subclass of it, aims at the SLOs given on the command line, with the simulated model's layers (its
    layer-wise overlap) and the fixed cost per transfer the simulator charges (link setup, control, proxy hop)."""
    cost = CostModelConfig(
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        num_layers=model.num_layers if not ns.no_layerwise else 1,
        transfer_setup_s=link.setup_s + (ns.transfer_fixed_ms + ns.proxy_hop_ms) / 1e3,
    )
    return policy_builder(ns.policy, parse_policy_args(ns.policy_args or ""), cost)


def _validate(ns: argparse.Namespace) -> int:
    """Replay every point of a ``benchmarks/e2e.py --profile`` run and print measured vs predicted latencies."""
    from vllm_disagg.planner import validate as v

    path = Path(ns.validate)
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(results, dict):
        raise ValueError(f"{path}: expected the results.json object benchmarks/e2e.py writes")
    profiles = {name: Profile.load(path.parent / name).refitted() for name in v.profile_files(results)}
    if not profiles:
        raise ValueError(f"{path} names no profiles: run benchmarks/e2e.py with --profile")
    rows = v.validate(
        results, profiles, shared_calibration=ns.calibration == "shared", stack_cpu=ns.stack_cpu
    )
    data = {"rows": [dataclasses.asdict(r) for r in rows]}
    _emit(ns, data, v.format_validation(rows))
    return 0


def _plots(
    ns: argparse.Namespace,
    workload: Workload,
    designs: Sequence[Design],
    rows: Sequence[tuple[str, float, Summary, Stability]],
    model: ModelSpec,
    cost: StepModel,
    engine: EngineConfig,
) -> list[str]:
    """latency_vs_rate.png from the sweep; timeline.png from one more run of each design with iterations kept."""
    from vllm_disagg.planner.plots import plot_latency_vs_rate, plot_timeline

    out = Path(ns.plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    series: dict[str, list[Any]] = {}
    for name, rate, summary, stable in rows:
        series.setdefault(name, []).append((rate, summary, stable.stable))
    workload_label = f"{ns.trace}" if ns.trace else f"prompt {ns.prompt}, output {ns.output}"
    made = [
        plot_latency_vs_rate(series, out / "latency_vs_rate.png", title=f"{model.name}: {workload_label}")
    ]
    colo = [d for d in designs if isinstance(d, Colocated)]
    dis = [d for d in designs if not isinstance(d, Colocated)]
    if colo and dis:
        rate = ns.timeline_rate or sorted(r for _, r, _, _ in rows)[len(rows) // 2]
        c = simulate_rate(
            workload, rate, colo[0], model, cost, engine=engine, record_iterations=True, seed=ns.seed
        )
        d = simulate_rate(
            workload, rate, dis[0], model, cost, engine=engine, record_iterations=True, seed=ns.seed
        )
        made.append(
            plot_timeline(
                c.iterations["c0"],
                d.iterations["d0"],
                out / "timeline.png",
                span=ns.timeline_span,
                title=f"{model.name} at {rate:g} req/s: {colo[0].name} vs {dis[0].name}",
            )
        )
    return [f"wrote {p}" for p in made]


# -- profile --------------------------------------------------------------------------------------------------
@_user_errors
def cmd_profile(ns: argparse.Namespace) -> int:
    import httpx

    from vllm_disagg.planner.profile import ProfileConfig, profile

    cfg = ProfileConfig(
        prompt_lens=ns.prompt_lens,
        repeats=ns.repeats,
        batches=ns.batches,
        decode_tokens=ns.decode_tokens,
        decode_prompt_tokens=ns.decode_prompt_tokens,
        timeout_s=ns.timeout,
        seed=ns.seed,
        tp=ns.tp,
        api_key=ns.api_key,
    )
    try:
        prof = profile(ns.url, model=ns.served_model, cfg=cfg, out=ns.out)
    except httpx.HTTPError as exc:
        print(f"error: {ns.url}: {exc!r}", file=sys.stderr)
        return 1
    lines = [f"model {prof.model} at {prof.source}", f"prefill: {describe_prefill_fit(prof)}"]
    by_len: dict[int, list[float]] = {}
    for pt in prof.prefill_points:
        by_len.setdefault(pt.prompt_tokens, []).append(pt.seconds)
    for n, times in sorted(by_len.items()):
        measured = statistics.median(times)
        lines.append(
            f"  {n:>6} tokens: measured {measured * 1e3:.1f} ms (median), fit {prefill_fit_s(prof, n) * 1e3:.1f} ms"
        )
    lines += [
        f"decode batch {p.batch:>4}, context {p.context_tokens:>5}: step {p.step_s * 1e3:.2f} ms"
        for p in prof.decode_points
    ]
    lines.append(f"KV capacity: {prof.kv_capacity_tokens or 'unknown'} tokens; wrote {ns.out}")
    _emit(ns, prof.model_dump(), "\n".join(lines))
    return 0


def prefill_fit_s(prof: Profile, tokens: int) -> float:
    """The profile's fitted prefill time of one prompt of ``tokens`` (its attention term included)."""
    return (
        prof.prefill_overhead_s + tokens / prof.prefill_tokens_per_s + prof.prefill_s_per_pair * tokens**2 / 2
    )


def describe_prefill_fit(prof: Profile) -> str:
    """The fitted prefill line, and its quadratic (attention) term when the fit found one."""
    rate = prof.prefill_tokens_per_s
    per_token = f"{rate:,.0f} tok/s" if math.isfinite(rate) else "no per-token term"
    text = f"{per_token} (+{prof.prefill_overhead_s * 1e3:.1f} ms per request)"
    if prof.prefill_s_per_pair > 0:
        text += f" + attention {prof.prefill_s_per_pair * 1e9:.3g} ns per query-key pair (P^2/2 pairs)"
    return text


def _one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser's usage errors as one line naming the option, without the 30-line usage text before it."""

    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")

    parser.error = error  # type: ignore[method-assign]
    return parser


def add_subcommands(subparsers: Any) -> None:
    """Add ``plan``, ``simulate`` and ``profile`` to an ``ArgumentParser.add_subparsers()`` object."""
    p = subparsers.add_parser(
        "plan", help="size prefill and decode pools for a workload (roofline or profile)"
    )
    _add_model_args(p)
    _add_hw_args(p)
    p.add_argument("--prompt", type=_COUNT, default=2048, help="mean input tokens per request (P)")
    p.add_argument("--output", type=_COUNT, default=256, help="mean output tokens per request (O)")
    p.add_argument("--rate", type=_NONNEGATIVE, default=0.0, help="target request rate (req/s) to size for")
    p.add_argument("--gpus", type=_bounded(int, 0), default=0, help="a GPU budget to split between the pools")
    p.add_argument("--max-util", type=_SHARE, default=0.8, help="utilisation cap when sizing for --rate")
    p.set_defaults(func=cmd_plan)
    _one_line_errors(p)

    s = subparsers.add_parser("simulate", help="simulate colocated vs disaggregated serving of a workload")
    _add_model_args(s)
    _add_hw_args(s)
    s.add_argument(
        "--design",
        choices=("both", "colocated", "disagg", "adaptive", "all"),
        default="both",
        help="both: colocated and disagg; adaptive: --replicas instances that each prefill and decode, the policy "
        "choosing per request (transfer either way or serve alone); all: the three",
    )
    s.add_argument("--prefill", type=_COUNT, default=1, help="prefill instances")
    s.add_argument("--decode", type=_COUNT, default=1, help="decode instances")
    s.add_argument(
        "--replicas", type=_COUNT, default=None, help="colocated replicas (default: prefill + decode)"
    )
    s.add_argument(
        "--rates", type=_csv(_POSITIVE), help="request rates, e.g. 2,4,8 (trace default: its own rate)"
    )
    s.add_argument(
        "--requests",
        type=_bounded(int, 1, high=MAX_REQUESTS),
        default=500,
        help=f"requests per rate, at most {MAX_REQUESTS:,} (see --duration)",
    )
    s.add_argument(
        "--duration",
        type=_POSITIVE,
        help="seconds of arrivals per rate instead of a fixed number of requests",
    )
    s.add_argument(
        "--warmup",
        type=_NONNEGATIVE,
        default=0.0,
        help="seconds of arrivals left out of the statistics (cold start)",
    )
    s.add_argument(
        "--prompt",
        default=None,
        help="N | uniform:LO:HI | lognormal:MEAN:SIGMA[:MIN[:MAX]] | exp:MEAN[:MIN[:MAX]] | gamma:MEAN:CV[:MIN[:MAX]] "
        f"(default lognormal:2048:0.5:16:{DEFAULT_PROMPT_MAX}, its mean and maximum lowered to half and all of a "
        "shorter context window)",
    )
    s.add_argument("--output", default="lognormal:256:0.5:4:2048", help="same forms as --prompt")
    s.add_argument(
        "--prefixes",
        type=_bounded(int, 0),
        default=0,
        help="shared prefixes the prompts begin with (each as often, shuffled; --prompt is then the rest)",
    )
    s.add_argument("--prefix-tokens", type=_COUNT, default=1024, help="tokens of each shared prefix")
    s.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    s.add_argument(
        "--burstiness", type=_POSITIVE, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)"
    )
    s.add_argument("--trace", help="JSONL with arrival_s, prompt_tokens, output_tokens (replaces synthetic)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--chunked-prefill", action="store_true", help="mix prompt chunks into decode steps (every instance)"
    )
    s.add_argument(
        "--policy",
        help="router policy to replay in the disaggregated and adaptive designs: a built-in name, module:Class or "
        "file.py:Class (instances are named p0.., d0.. in the disaggregated design and a0.. in the adaptive one)",
    )
    s.add_argument(
        "--policy-args",
        metavar="JSON",
        help="the policy constructor's keyword arguments as a JSON object, e.g. '{\"threshold_tokens\": 512}'",
    )
    for pool in ("colocated", "prefill", "decode"):
        s.add_argument(
            f"--{pool}-routing",
            choices=ROUTINGS,
            default="least-loaded",
            help=f"how requests are spread over the {pool} {'replicas' if pool == 'colocated' else 'pool'}",
        )
    s.add_argument(
        "--ttft-slo-ms",
        type=_POSITIVE,
        default=DEFAULT_SLOS.ttft_slo_s * 1e3,
        help="TTFT SLO (default: the proxy's --ttft-slo-s)",
    )
    s.add_argument("--goodput", action="store_true", help="search the highest rate with >= 90%% in SLO")
    s.add_argument("--plot-dir", help="write latency_vs_rate.png and timeline.png here")
    s.add_argument(
        "--timeline-rate", type=_POSITIVE, help="rate of the timeline plot (default: the middle rate)"
    )
    s.add_argument("--timeline-span", type=_POSITIVE, default=1.0, help="seconds shown in the timeline plot")
    s.add_argument(
        "--validate",
        metavar="RESULTS",
        help="instead of simulating: replay each point of a `benchmarks/e2e.py --profile` results.json (with the "
        "profiles it names, beside it) and print measured vs predicted TTFT/TPOT with ratios",
    )
    s.add_argument(
        "--calibration",
        choices=("shared", "per-design"),
        default="shared",
        help="--validate, where the run did not read the stack's CPU from /proc: fit the stack's cost per emitted "
        "token across every design's zero-load runs at once (default), or to each design's own",
    )
    s.add_argument(
        "--stack-cpu",
        choices=("shared", "serial"),
        default="shared",
        help="--validate: spread the stack's CPU per emitted token (read from /proc where the run recorded it) "
        "over every engine's core, as the OS runs it (default); or charge a fitted cost inside the emitting "
        "instance's iterations (for comparison)",
    )
    s.set_defaults(func=cmd_simulate)
    _one_line_errors(s)

    f = subparsers.add_parser("profile", help="measure a running vLLM server's prefill rate and decode steps")
    f.add_argument("url", help="e.g. http://127.0.0.1:8000")
    f.add_argument("--served-model", help="model name (default: the first of /v1/models)")
    f.add_argument("--prompt-lens", type=_csv(int), default=(128, 512, 1024, 2048))
    f.add_argument("--batches", type=_csv(int), default=(1, 4, 16, 32))
    f.add_argument("--decode-tokens", type=int, default=32)
    f.add_argument("--decode-prompt-tokens", type=int, default=128)
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument("--timeout", type=float, default=600.0)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--tp", type=int, default=1, help="GPUs behind the server")
    f.add_argument("--api-key", help="the server's --api-key, if it has one")
    f.add_argument("--out", default="profile.json")
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_profile)
    _one_line_errors(f)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_disagg.planner.cli", description=__doc__)
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
