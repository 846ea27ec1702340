"""Human-readable tables for plan and simulate results (pure string formatting)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm_disagg.planner.goodput import GoodputResult
from vllm_disagg.planner.metrics import PERCENTILES, Summary
from vllm_disagg.planner.plan import PoolPlan
from vllm_disagg.planner.stability import Stability


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _ms(s: float) -> str:
    return "-" if s is None or math.isnan(s) else f"{s * 1e3:.1f}"


def format_plan(p: PoolPlan) -> str:
    """Two-column table: the question on the left, the number (and how it was derived) on the right."""
    be = (
        f"never up to {p.break_even_search_tokens:,} tokens (at every length the transfer's fixed cost and exposed "
        "tail outweigh the prefill it saves: prefill on the decode instance)"
    )
    if not math.isinf(p.break_even_prompt_tokens):
        be = f"{p.break_even_prompt_tokens:,.0f} tokens (shorter prompts: prefill on the decode instance)"
    rows = [
        ("model", f"{p.model}: {p.params / 1e9:.2f}B params, {_bytes(p.weight_bytes)} of weights"),
        ("rates from", f"{p.source}, {p.gpu} x{p.tp} per instance"),
        ("workload", f"P={p.prompt_tokens} in, O={p.output_tokens} out, r = P/O = {p.r:.2f}"),
        (
            "KV bytes/token",
            f"{p.kv_bytes_per_token:,} B ({p.kv_bytes_per_token / 1024:.1f} KiB)"
            + (f", {p.kv_copies} copies over the {p.tp} ranks" if p.kv_copies > 1 else ""),
        ),
        ("KV bytes/request", _bytes(p.kv_bytes_per_request)),
        (
            f"transfer over {p.link}",
            f"{p.transfer_s * 1e3:.2f} ms whole, {p.exposed_transfer_s * 1e3:.2f} ms exposed after prefill",
        ),
        ("prefill rate R_p", f"{p.prefill_tokens_per_s:,.0f} tok/s per GPU"),
        (
            "decode rate R_d",
            f"{p.decode_tokens_per_s:,.0f} tok/s per GPU (batch {p.decode_batch}, step {p.decode_step_s * 1e3:.1f} ms"
            f"{' <= ' if p.decode_meets_slo else ' > '}TPOT SLO {p.tpot_slo_s * 1e3:g} ms; the batch is capped by "
            f"{p.decode_bound})",
        ),
        ("R_p/R_d", f"{p.rp_over_rd:.2f}"),
        ("prefill share", f"{p.prefill_share:.1%} of GPUs = r/(r + R_p/R_d)"),
        ("break-even prompt", be),
    ]
    t = p.break_even_terms
    if t is not None:
        rows.append(
            (
                "  = fixed / per token",
                f"({t.link_setup_s * 1e3:.2f} ms link setup + {t.engine_fixed_s * 1e3:.2f} ms transfer control + "
                f"{t.proxy_hop_s * 1e3:.2f} ms proxy hop) / ({t.prefill_s_per_token * 1e6:.2f} us prefill avoided "
                f"- {t.exposed_s_per_token * 1e6:.3f} us transfer tail exposed) at {t.at_tokens:,} tokens",
            )
        )
    if p.target_rate > 0:
        rows.append(
            (
                f"for {p.target_rate:g} req/s",
                f"{p.n_prefill} prefill + {p.n_decode} decode instances ({(p.n_prefill + p.n_decode) * p.tp} GPUs) "
                f"at <= {p.max_util:.0%} load"
                + (" (prefill sized by its links' bandwidth)" if p.prefill_bound == "link" else "")
                + f"; colocated: {p.n_colocated} ({p.n_colocated * p.tp} GPUs, ignoring interference)",
            )
        )
    if p.budget_instances >= 2:
        n_p, n_d = p.budget_split
        rows.append(
            (
                f"{p.budget_instances * p.tp} GPUs",
                f"best split {n_p}P:{n_d}D sustains {p.budget_max_rate:.2f} req/s at full load",
            )
        )
    if p.kv_capacity_tokens is not None:
        rows.insert(5, ("KV cache/instance", f"{p.kv_capacity_tokens:,} tokens"))
    rows.extend(("WARNING", w) for w in p.warnings)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_sim_table(rows: Sequence[tuple[str, float, Summary, Stability | None]]) -> str:
    """One line per (design, rate): TTFT and TPOT percentiles in ms, SLO attainment, drops, and the busiest pool's
    utilisation. Past capacity the percentiles are not shown: they only measure how long the run was."""
    head = ["design", "rate"]
    head += [f"TTFT p{q}" for q in PERCENTILES] + [f"TPOT p{q}" for q in PERCENTILES]
    head += ["SLO met", "dropped", "load (busiest pool)"]
    body = []
    for design, rate, s, stable in rows:
        line = [design, f"{rate:g}"]
        if stable is not None and not stable.stable:
            line += ["unstable"] * (2 * len(PERCENTILES)) + ["-"]
        else:
            line += [_ms(s.ttft_s[q]) for q in PERCENTILES] + [_ms(s.tpot_s[q]) for q in PERCENTILES]
            line.append(f"{s.attainment:.1%}")
        line += [str(s.dropped), stable.describe() if stable is not None else "-"]
        body.append(line)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = []
    for r in [head, ["-" * w for w in widths], *body]:
        lines.append(
            "  ".join(
                f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    if rows:
        s0 = rows[0][2]
        lines.append(f"(ms; SLO: TTFT <= {s0.ttft_slo_s * 1e3:g} ms and TPOT <= {s0.tpot_slo_s * 1e3:g} ms)")
        if s0.warmup_excluded:
            lines.append(f"({s0.warmup_excluded} requests of the warm-up window left out of the statistics)")
    if any(st is not None and st.all_dropped for *_, st in rows):
        lines.append(
            "all dropped: no request fits an instance's KV cache (prompt + output tokens over its capacity), so "
            "nothing was served: use more GPUs per instance (--tp) or shorter requests"
        )
    if any(st is not None and not st.stable and not st.all_dropped for *_, st in rows):
        lines.append(
            "UNSTABLE: offered load >= capacity of a pool (load column: busy seconds per second per instance); "
            "its queue grows without bound, so latency percentiles depend only on the run's length"
        )
    return "\n".join(lines)


def format_goodput(design: str, g: GoodputResult) -> str:
    probes = ", ".join(
        f"{r:.3g}:" + ("unstable" if r in g.unstable else f"{a:.1%}") for r, a in sorted(g.probes)
    )
    return f"goodput {design}: {g.rate:.3g} req/s with >= {g.target:.0%} of requests in SLO (probes {probes})"


def winners(rows: Sequence[tuple[str, float, Summary, Stability | None]]) -> list[str]:
    """Per rate, which design serves the most requests within the SLOs (attainment; a design past capacity at that
    rate does not count), with the others' share beside it."""
    lines = []
    for rate in sorted({r for _, r, _, _ in rows}):
        at = [(d, s.attainment, st is None or st.stable) for d, r, s, st in rows if r == rate]
        live = [a for a in at if a[2]]
        if not live:
            lines.append(f"rate {rate:g}: no design serves it (each is past capacity or drops every request)")
            continue
        best = max(live, key=lambda a: a[1])
        tied = [d for d, a, _ in live if round(a, 3) == round(best[1], 3)]
        if len(tied) > 1:
            lines.append(f"rate {rate:g}: tie, {' and '.join(tied)} each serve {best[1]:.1%} within the SLOs")
            continue
        others = ", ".join(f"{d} {a:.1%}" + ("" if ok else " (unstable)") for d, a, ok in at if d != best[0])
        lines.append(f"rate {rate:g}: {best[0]} serves {best[1]:.1%} within the SLOs ({others})")
    return lines
