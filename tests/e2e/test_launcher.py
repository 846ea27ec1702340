"""`vllm-disagg launch`: config validation, the processes it would start, and one real launch on the tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from support.paths import ROOT
from support.vllm_servers import launched

from vllm_disagg.tools.harness import free_port
from vllm_disagg.tools.launcher import (
    LaunchConfig,
    LaunchError,
    TierSpec,
    build_servers,
    build_tier,
    preflight,
    proxy_args,
    proxy_env,
)


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
            first["kv_connector"] == "DisaggConnector"
            and "shared_secret" not in first["kv_connector_extra_config"]
        )
        assert server.environment()["VLLM_DISAGG_SECRET"] == cfg.connector["shared_secret"]  # not on `ps`
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
        # the instances' KV events reach the proxy's prefix index
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            blocks = [
                float(ln.split()[-1])
                for ln in text.splitlines()
                if ln.startswith("vllm_disagg_prefix_index_blocks")
            ]
            if sum(blocks) > 0:
                break
            assert time.monotonic() < deadline, "no KV event reached the proxy's index"
            time.sleep(0.2)


def _load(tmp_path: Path, text: str) -> LaunchConfig:
    path = tmp_path / "launch.yaml"
    path.write_text(text)
    return LaunchConfig.load(str(path))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("model: m\ninstances: [{role: prefill, cpu_core: '0'}, {role: decode}]",
         "instances[0]: unknown key 'cpu_core' (did you mean 'cpu_cores'?)"),
        ("model: m\ninstances: [{role: prefill, port: 9100}, {role: decode, port: 9100}]",
         "instances[1].port and instances[0].port are both port 9100"),
        ("model: m\ninstances: [{role: prefill, port: 70000}, {role: decode}]", "instances[0].port: Input should be"),
        ("model: m\nconnector: {side_channel_port: 5600}\ninstances: [{role: prefill}, {role: decode}]",
         "connector.side_channel_port would be the same for every instance"),
        ("model: m\nproxy: {args: ['--port', '9']}\ninstances: [{role: prefill}, {role: decode}]",
         "proxy.args: --port are the launcher's to set"),
        ("model: m\ninstances: [{role: prefill, name: a}, {role: decode, name: a}]", "instance names must differ"),
        ("model: m\ninstances: [{role: prefill, cpu_cores: zero}, {role: decode}]", "'zero' is not a cpu-list"),
        ("model: [m", "not YAML"),
        ("", "expected a mapping of settings"),
    ],
)  # fmt: skip
def test_a_launch_file_mistake_is_one_line_naming_the_field(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(LaunchError) as caught:
        _load(tmp_path, text)
    assert error in str(caught.value) and "\n" not in str(caught.value)


def test_what_only_this_host_can_say_is_checked_before_anything_starts(
    tmp_path: Path, tiny_model: str
) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_model)
    cfg = _load(tmp_path, "model: models/tiny\ninstances: [{role: prefill, cpu_cores: 0}, {role: decode}]")
    assert cfg.model == str(tmp_path / "models" / "tiny")  # from the file's folder, wherever one runs it from
    assert cfg.instances[0].cpu_cores == "0"
    preflight(cfg)
    with pytest.raises(LaunchError, match="model: ./nope does not exist"):
        preflight(cfg.model_copy(update={"model": "./nope"}))
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    with pytest.raises(LaunchError, match=f"proxy.port: port {port} on 127.0.0.1 is taken"):
        preflight(cfg.model_copy(update={"proxy": cfg.proxy.model_copy(update={"port": port})}))
    held.close()
    absent = max(os.sched_getaffinity(0)) + 1
    odd = cfg.model_copy(
        update={"instances": [cfg.instances[0].model_copy(update={"cpu_cores": str(absent)})]}
    )
    with pytest.raises(LaunchError, match=f"core.s. \\[{absent}\\] are not available here"):
        preflight(odd)
    if importlib.util.find_spec("lmcache") is None:
        with pytest.raises(LaunchError, match="tier: lmcache is not installed in this Python"):
            preflight(cfg.model_copy(update={"tier": TierSpec()}))
    with pytest.raises(LaunchError, match="tokenizer: /nonexistent/tok does not exist"):
        preflight(cfg.model_copy(update={"tokenizer": "/nonexistent/tok"}))
    # what vLLM itself resolves is not refused: a Hugging Face id, a bucket URI; a proxy port of 0 is a free one
    preflight(cfg.model_copy(update={"tokenizer": "meta-llama/Meta-Llama-3-8B-Instruct"}))
    preflight(cfg.model_copy(update={"model": "s3://bucket/models/llama/8b"}))
    assert _load(tmp_path, "model: m\nproxy: {port: 0}\ninstances: [{role: both}]").proxy.port == 0
    # a port the last run left in TIME_WAIT is free to the servers (they bind with SO_REUSEADDR), so to the check
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    waiting = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", waiting))
    conn, _ = srv.accept()
    conn.close()  # the server's side closes first: TIME_WAIT on its port
    cli.recv(1)
    cli.close()
    srv.close()
    preflight(cfg.model_copy(update={"instances": [cfg.instances[0].model_copy(update={"port": waiting})]}))
    # secrets travel in the environment, not on command lines every local user can read
    secret = cfg.model_copy(
        update={
            "connector": {"shared_secret": "s3"},
            "proxy": cfg.proxy.model_copy(update={"admin_key": "a"}),
        }
    )
    servers, specs = build_servers(secret)
    assert (
        not any("s3" in a for s in servers for a in s.command())
        and servers[0].environment()["VLLM_DISAGG_SECRET"] == "s3"
    )
    assert "s3" not in proxy_args(secret, specs) and proxy_env(secret) == {
        "VLLM_DISAGG_PROXY_SHARED_SECRET": "s3",
        "VLLM_DISAGG_PROXY_ADMIN_KEY": "a",
    }


_FAKE_SERVER = """
import os, sys, time
os.fork()  # an 'EngineCore' in the same process group, as vLLM's API server has
time.sleep(600)
"""


def test_a_killed_parent_leaves_no_instance_process(tmp_path: Path) -> None:
    """SIGKILL runs nothing of the launcher (or a test session): the reaper stops the instances' whole groups, not
    only the API server the parent-death signal reaches."""
    script = f"""
import sys, time
from vllm_disagg.tools.harness import VLLMServer
s = VLLMServer("m", log_path=__import__("pathlib").Path({str(tmp_path / "s.log")!r}))
s.command = lambda: [sys.executable, "-c", {_FAKE_SERVER!r}]
s.start()
print(s.proc.pid, flush=True)
time.sleep(600)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pgid = int(parent.stdout.readline())
    deadline = time.monotonic() + 10
    while len(_group(pgid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_group(pgid)) == 2  # the server and its child
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 15
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group(pgid) == []


def _group(pgid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
    return out.split()


def test_ctrl_c_while_instances_start_stops_them_at_once(tmp_path: Path, tiny_model: str) -> None:
    """Ctrl-C used to wait until every instance was up (minutes on a GPU host), print 'ready', then stop."""
    cfg = {
        "model": tiny_model,
        "log_dir": str(tmp_path / "logs"),
        "instances": [{"role": "prefill"}, {"role": "decode"}],
        "proxy": {"port": free_port()},
    }
    (tmp_path / "launch.yaml").write_text(yaml.safe_dump(cfg))
    script = f"""
import sys
from vllm_disagg.tools import harness
harness.VLLMServer.command = lambda self: [sys.executable, "-c", {_FAKE_SERVER!r}]  # never healthy
from vllm_disagg.cli import main
sys.exit(main(["launch", {str(tmp_path / "launch.yaml")!r}]))
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "starting 2 vLLM instance(s)" in line, line
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "SIGINT while starting" in out and "all processes stopped" in out, out
    assert "ready" not in out
    left = subprocess.run(
        ["pgrep", "-f", "an 'EngineCore' in the same process group"], capture_output=True, text=True
    )
    assert left.stdout.split() == []


def test_the_schema_lists_every_key_a_launch_file_takes(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_disagg.cli import main
    from vllm_disagg.tools.launcher import InstanceSpec, ProxySpec

    assert main(["launch", "--schema"]) == 0
    out = capsys.readouterr().out
    for model in (LaunchConfig, InstanceSpec, ProxySpec, TierSpec):
        for name, field in model.model_fields.items():
            assert f"  {name} " in out and field.description, (
                name
            )  # each key listed, and each says what it is
    with pytest.raises(SystemExit, match="give a launch file"):
        main(["launch"])
