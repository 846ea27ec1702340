"""`vllm-disagg` command line. Each subcommand imports its module lazily so the proxy never pulls vLLM or torch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_tiny_model(ns: argparse.Namespace) -> int:
    from vllm_disagg.tools.tiny_model import TinyLlamaSpec, is_tiny_model, write_tiny_model

    spec = TinyLlamaSpec(seed=ns.seed, num_hidden_layers=ns.layers)
    if is_tiny_model(ns.dir, spec) and not ns.force:
        print(f"tiny model already in {ns.dir} (seed {spec.seed}); --force rewrites it")
        return 0
    out = write_tiny_model(ns.dir, spec)
    print(
        f"wrote tiny Llama to {out}: {spec.num_hidden_layers} layers, {spec.num_attention_heads} heads, "
        f"{spec.num_key_value_heads} KV heads, head_dim {spec.head_dim}, vocab {spec.vocab_size}, seed {spec.seed}"
    )
    return 0


def _cmd_fix_vllm_cpu(ns: argparse.Namespace) -> int:
    from vllm_disagg.tools.vllm_cpu_alias import install_alias

    path = install_alias()
    print(
        f"wrote {path}: `vllm serve` now works with vllm-cpu"
        if path
        else "nothing to do: `vllm` metadata present"
    )
    return 0


def _cmd_demo(ns: argparse.Namespace) -> int:
    from vllm_disagg.tools.demo import run_demo

    return run_demo(ns)


def _cmd_launch(ns: argparse.Namespace) -> int:
    from vllm_disagg.tools.launcher import LaunchConfig, LaunchError, launch, schema_text

    if ns.schema:
        print(schema_text())
        return 0
    if not ns.config:
        raise SystemExit(
            "launch: give a launch file (e.g. examples/launch-tiny-cpu.yaml); --schema lists its keys"
        )
    try:
        return launch(LaunchConfig.load(ns.config))
    except LaunchError as exc:
        raise SystemExit(f"launch: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-disagg", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "tiny-model", help="write the tiny random-weight Llama + tokenizer used by tests and the demo"
    )
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--force", action="store_true")
    t.set_defaults(func=_cmd_tiny_model)

    f = sub.add_parser(
        "fix-vllm-cpu", help="make the `vllm` console script work with the vllm-cpu distribution"
    )
    f.set_defaults(func=_cmd_fix_vllm_cpu)

    d = sub.add_parser("demo", help="run the demo on the tiny model (real vLLM CPU processes)")
    d.add_argument("--model-dir", default=".artifacts/tiny-model")
    d.add_argument("--out", default=".artifacts/demo")
    d.add_argument("--duration", type=float, default=40.0, help="seconds of traffic per design")
    d.add_argument("--short-rate", type=float, default=2.0, help="short streams per second")
    d.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second")
    d.add_argument("--long-prompt", type=int, default=1800, help="tokens per long prompt")
    d.set_defaults(func=_cmd_demo)

    la = sub.add_parser(
        "launch", help="start prefill/decode vLLM instances and the proxy on one host from a YAML file"
    )
    la.add_argument("config", nargs="?", help="e.g. examples/launch-tiny-cpu.yaml")
    la.add_argument("--schema", action="store_true", help="print every key a launch file takes, and exit")
    la.set_defaults(func=_cmd_launch)

    from vllm_disagg.planner.cli import add_subcommands as add_planner
    from vllm_disagg.router.server import add_subcommand as add_proxy

    add_planner(sub)
    add_proxy(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
