"""`vllm-disagg launch`: config validation, the processes it would start, and one real launch on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml
from support.paths import ROOT
from support.vllm_servers import launched

from vllm_disagg.tools.harness import free_port
from vllm_disagg.tools.launcher import LaunchConfig, build_servers, build_tier, proxy_args


@pytest.mark.parametrize("name", ["launch-tiny-cpu.yaml", "launch-gpu-llama8b.yaml"])
def test_example_configs_validate(name: str) -> None:
    cfg = LaunchConfig.load(str(ROOT / "examples" / name))
    servers, specs = build_servers(cfg)
    assert len(servers) == len(cfg.instances)
    for server, inst in zip(servers, cfg.instances, strict=True):
        cmd = server.command()
        ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert ktc["kv_connector"] == "DisaggConnector"
        assert ktc["kv_connector_extra_config"]["transport"] == cfg.connector["transport"]
        if inst.gpus is not None:
            assert server.environment()["CUDA_VISIBLE_DEVICES"] == inst.gpus
        if inst.cpu_cores is not None:
            assert server.environment()["VLLM_CPU_OMP_THREADS_BIND"] == inst.cpu_cores
    args = proxy_args(cfg, specs)
    assert args.count("--prefill") == sum(i.role == "prefill" for i in cfg.instances)
    assert args.count("--decode") == sum(i.role == "decode" for i in cfg.instances)
    assert all(";side=" in s for s in specs)


def test_the_proxy_gets_a_local_tokenizer_or_none(tiny_model: str) -> None:
    """A model id whose files are not on this machine is no --tokenizer (the proxy then asks the instances'
    /tokenize) instead of a path the proxy fails to open at start-up."""
    cfg = LaunchConfig.load(str(ROOT / "examples" / "launch-gpu-llama8b.yaml"))
    _, specs = build_servers(cfg)
    assert "--tokenizer" not in proxy_args(cfg, specs)
    cfg = cfg.model_copy(update={"tokenizer": tiny_model})
    args = proxy_args(cfg, specs)
    assert args[args.index("--tokenizer") + 1] == tiny_model


def test_tier_config_composes_disagg_over_lmcache() -> None:
    """With a tier, P/D instances run DisaggTierConnector [DisaggConnector first, LMCacheMPConnector -> the tier's
    ZMQ port], a colocated one LMCacheMPConnector alone, the server gets the disk tier, and the proxy the bandwidth."""
    raw = yaml.safe_load((ROOT / "examples" / "launch-tiny-cpu-lmcache.yaml").read_text())
    raw["instances"].append({"role": "colocated", "name": "solo"})
    cfg = LaunchConfig.model_validate(raw)
    tier = build_tier(cfg)
    assert tier is not None
    cmd = tier.command()
    assert cmd[cmd.index("--supported-transfer-mode") + 1] == "engine_driven"
    l2 = json.loads(cmd[cmd.index("--l2-adapter") + 1])
    assert l2 == {"type": "fs", "base_path": ".artifacts/lmcache-disk"}
    servers, specs = build_servers(cfg, tier)
    for server, inst in zip(servers, cfg.instances, strict=True):
        c = server.command()
        ktc = json.loads(c[c.index("--kv-transfer-config") + 1])
        if inst.role == "colocated":
            assert ktc == tier.mp_config()
            continue
        assert ktc["kv_connector"] == "DisaggTierConnector"
        first, second = ktc["kv_connector_extra_config"]["connectors"]
        assert (
            first["kv_connector"] == "DisaggConnector" and first["kv_connector_extra_config"]["shared_secret"]
        )
        assert second["kv_connector_extra_config"]["lmcache.mp.port"] == tier.zmq_port
    args = proxy_args(cfg, specs)
    assert args[args.index("--tier-bytes-per-s") + 1] == "2000000000.0"
    assert build_tier(LaunchConfig.load(str(ROOT / "examples" / "launch-tiny-cpu.yaml"))) is None


def test_bad_connector_settings_fail_before_anything_starts() -> None:
    base = yaml.safe_load((ROOT / "examples" / "launch-tiny-cpu.yaml").read_text())
    base["connector"]["trasport"] = "tcp"
    with pytest.raises(ValueError, match="unknown key .trasport."):
        LaunchConfig.model_validate(base)
    base = yaml.safe_load((ROOT / "examples" / "launch-tiny-cpu.yaml").read_text())
    base["instances"] = [{"role": "prefill"}]
    with pytest.raises(ValueError, match="pairs"):
        LaunchConfig.model_validate(base)


@pytest.mark.vllm
def test_launch_serves_through_the_proxy_and_ctrl_c_leaves_no_process(
    tiny_model: str, tmp_path: Path
) -> None:
    cfg = yaml.safe_load((ROOT / "examples" / "launch-tiny-cpu.yaml").read_text())
    port = free_port()
    cfg.update(model=tiny_model, log_dir=str(tmp_path / "logs"))
    cfg["proxy"]["port"] = port
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with launched(path):
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": tiny_model, "prompt": "Hello " * 300, "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200 and r.headers["x-disagg-path"]
