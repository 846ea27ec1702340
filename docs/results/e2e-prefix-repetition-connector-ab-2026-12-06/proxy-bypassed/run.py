"""Proxy bypassed: one plain and one DisaggConnector instance, each pinned to its own core, each driven by its own
`vllm bench serve` (benchmarks/e2e.py's prefix-repetition dataset) at the same time; round 1 swaps the cores.

    python docs/results/e2e-prefix-repetition-connector-ab-2026-12-06/proxy-bypassed/run.py [RATE per instance]
"""

import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import e2e  # noqa: E402

from vllm_disagg.tools.harness import (  # noqa: E402
    VLLMServer,
    disagg_connector_args,
    free_port,
    start_many,
    tiny_model_args,
)


def one_round(rnd: int, cores: dict[str, str], rate: float, out: Path) -> None:
    servers = {
        name: VLLMServer(
            e2e.MODEL,
            args=[*tiny_model_args(), *e2e.engine_args(2048),
                  *(disagg_connector_args(free_port()) if name == "connector" else [])],
            cpu_cores=core,
            name=f"{name}-{core}",
        )
        for name, core in cores.items()
    }  # fmt: skip
    start_many(list(servers.values()))
    res: dict[str, dict[str, Any]] = {}

    def serve(name: str, server: VLLMServer) -> None:
        res[name] = e2e.bench_serve(server.url, e2e.DATASETS["prefix-repetition"], rate, 300,
                                    out / f"{name}-r{rnd}.json", "ttft:1500 tpot:25", seed=rnd + 1)  # fmt: skip

    try:
        threads = [threading.Thread(target=serve, args=item) for item in servers.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for name, b in res.items():
            print(f"round {rnd} {name} core {cores[name]}: p50 TPOT {b['median_tpot_ms']:.2f} "
                  f"p95 TPOT {b['p95_tpot_ms']:.2f} p95 TTFT {b['p95_ttft_ms']:.1f} "
                  f"goodput {b.get('request_goodput')}", flush=True)  # fmt: skip
    finally:
        for s in servers.values():
            s.stop()


def main() -> None:
    rate = float(sys.argv[1]) if len(sys.argv) > 1 else 12.0
    out = Path("/tmp/proxy-bypassed")
    out.mkdir(exist_ok=True)
    for rnd, cores in enumerate(({"plain": "0", "connector": "1"}, {"plain": "1", "connector": "0"})):
        one_round(rnd, cores, rate, out)


if __name__ == "__main__":
    main()
