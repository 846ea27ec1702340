"""A small, pure-Python subset of kustomize: renders this repository's kustomizations without kubectl.

Why: the tests validate every overlay offline (no kubectl or kustomize binary can be fetched in CI), and people
without kubectl can still see what an overlay produces::

    python deploy/render.py deploy/kubernetes/overlays/cpu-demo > cpu-demo.yaml

What it supports is exactly what the manifests under ``deploy/kubernetes`` use, with kustomize's semantics:
``resources`` (files and kustomization directories), ``namespace``, ``labels`` (``includeSelectors`` /
``includeTemplates``) and ``commonLabels``, ``images``, ``replicas``, ``configMapGenerator`` /
``secretGenerator`` (``literals``, ``files``, ``envs``; a content-hash name suffix unless disabled, with references
rewritten), and ``patches`` (strategic merge, with or without a ``target``, or JSON 6902 operation lists). Any
other key is an error rather than being ignored, and so is a patch that matches nothing. The hash suffix is a
sha256 of the content, not kustomize's exact encoding: names differ from ``kubectl kustomize``, behaviour does not.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "labels",
    "commonLabels",
    "images",
    "replicas",
    "configMapGenerator",
    "secretGenerator",
    "generatorOptions",
    "patches",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PriorityClass",
    "StorageClass",
    "PersistentVolume",
    "APIService",
}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
# Output order, like kustomize's legacy sort: what others depend on first.
KIND_ORDER = [
    "Namespace",
    "ServiceAccount",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "PersistentVolumeClaim",
    "Service",
    "Deployment",
    "StatefulSet",
    "DaemonSet",
    "Job",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
]
# Strategic-merge keys of the list fields our patches touch (Kubernetes' patchMergeKey for each).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "envFrom": None,
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}


class RenderError(ValueError):
    """The kustomization uses something this renderer does not support, or is inconsistent."""


@dataclass
class Rendered:
    objects: list[Obj]
    # (kind, name before the hash suffix) -> generated name, for references written in terms of the former.
    generated: dict[tuple[str, str], str] = field(default_factory=dict)


# -- YAML ------------------------------------------------------------------------------------------------------


def read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise RenderError(f"cannot read {path}: {exc.strerror}") from None


def load_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(read(path)) if d is not None]


def dump(objects: list[Obj]) -> str:
    return "---\n".join(yaml.safe_dump(o, sort_keys=False, default_flow_style=False) for o in objects)


def obj_id(o: Obj) -> tuple[str, str, str]:
    meta = o.get("metadata") or {}
    return (str(o.get("kind")), str(meta.get("namespace") or ""), str(meta.get("name")))


# -- strategic merge (the subset Kubernetes defines for the fields above) -----------------------------------------


def _merge_key(field_name: str, items: list[Any]) -> str | None:
    if field_name == "ports":  # containerPort for container ports, port for Service ports
        if all(isinstance(i, dict) and "containerPort" in i for i in items):
            return "containerPort"
        if all(isinstance(i, dict) and "port" in i for i in items):
            return "port"
        return None
    return MERGE_KEYS.get(field_name)


def strategic_merge(base: Any, patch: Any, field_name: str = "") -> Any:
    """Maps merge recursively (null deletes a key); lists with a merge key merge by it, other lists replace."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if patch.get("$patch") == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list):
        key = _merge_key(field_name, base + patch)
        if key is None:
            return copy.deepcopy(patch)
        out_list = list(base)
        for item in patch:
            idx = next((i for i, b in enumerate(out_list) if b.get(key) == item.get(key)), None)
            if item.get("$patch") == "delete":
                if idx is not None:
                    out_list.pop(idx)
            elif idx is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[idx] = strategic_merge(out_list[idx], item, field_name)
        return out_list
    return copy.deepcopy(patch)


# -- JSON 6902 -----------------------------------------------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        try:
            doc = doc[int(part)] if isinstance(doc, list) else doc[part]
        except (KeyError, IndexError, ValueError):
            raise RenderError(f"JSON patch path {path!r}: no {part!r}") from None
    return doc


def json6902(doc: Obj, ops: list[Obj]) -> Obj:
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, path = op.get("op"), str(op.get("path"))
        parts = _pointer(path)
        parent = _walk(doc, parts[:-1], path)
        last = parts[-1]
        if kind == "test":
            if _walk(doc, parts, path) != op.get("value"):
                raise RenderError(f"JSON patch test failed at {path}")
        elif kind == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif kind in ("replace", "remove"):
            _walk(doc, parts, path)  # must exist
            if kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            else:
                parent[int(last) if isinstance(parent, list) else last] = copy.deepcopy(op["value"])
        else:
            raise RenderError(f"JSON patch op {kind!r} is not supported")
    return doc


# -- transformers ---------------------------------------------------------------------------------------------------


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for req in filter(None, (r.strip() for r in selector.split(","))):
        if "!=" in req:
            k, v = req.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in req:
            k, v = req.split("=", 1)
            if labels.get(k.strip().rstrip("=")) != v.strip().lstrip("="):
                return False
        elif labels.get(req) is None:
            return False
    return True


def _target_matches(o: Obj, target: Obj) -> bool:
    group, _, version = str(o.get("apiVersion", "")).rpartition("/")
    meta = o.get("metadata") or {}
    checks: list[tuple[str, Callable[[str], bool]]] = [
        ("kind", lambda v: o.get("kind") == v),
        ("group", lambda v: group == v),
        ("version", lambda v: version == v),
        ("name", lambda v: re.fullmatch(v, str(meta.get("name"))) is not None),
        ("namespace", lambda v: re.fullmatch(v, str(meta.get("namespace") or "")) is not None),
        ("labelSelector", lambda v: _selector_matches(v, meta.get("labels") or {})),
    ]
    unknown = set(target) - {k for k, _ in checks}
    if unknown:
        raise RenderError(f"patch target keys not supported: {sorted(unknown)}")
    return all(check(str(target[key])) for key, check in checks if key in target)


def _pod_templates(o: Obj) -> Iterator[Obj]:
    if o.get("kind") in WORKLOADS:
        yield o.setdefault("spec", {}).setdefault("template", {})


def add_labels(objects: list[Obj], pairs: dict[str, str], selectors: bool, templates: bool) -> None:
    for o in objects:
        o.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        kind = o.get("kind")
        if templates or selectors:
            for tmpl in _pod_templates(o):
                tmpl.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        if not selectors:
            continue
        if kind in WORKLOADS and kind != "Job" or kind == "PodDisruptionBudget":
            spec = o.setdefault("spec", {})
            spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(pairs)
        elif kind == "Service":
            o.setdefault("spec", {}).setdefault("selector", {}).update(pairs)


def _split_image(image: str) -> tuple[str, str]:
    """(name, the tag/digest suffix including its separator)."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def set_images(objects: list[Obj], images: list[Obj]) -> None:
    for o in objects:
        for tmpl in _pod_templates(o):
            spec = tmpl.get("spec") or {}
            for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
                name, suffix = _split_image(str(c.get("image", "")))
                for img in images:
                    if img.get("name") != name:
                        continue
                    if "digest" in img:
                        suffix = "@" + str(img["digest"])
                    elif "newTag" in img:
                        suffix = ":" + str(img["newTag"])
                    c["image"] = str(img.get("newName", name)) + suffix


# -- generators -------------------------------------------------------------------------------------------------------


def _env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in read(path).splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise RenderError(f"{path}: {line!r} is not KEY=VALUE")
            out[key.strip()] = value
    return out


def _generate(kind: str, spec: Obj, base: Path, options: Obj) -> Obj:
    data: dict[str, str] = {}
    for lit in spec.get("literals") or []:
        key, sep, value = str(lit).partition("=")
        if not sep:
            raise RenderError(f"{kind} {spec.get('name')}: literal {lit!r} is not KEY=VALUE")
        data[key] = value
    for entry in spec.get("files") or []:
        key, sep, rel = str(entry).partition("=")
        if not sep:
            key, rel = Path(entry).name, entry
        data[key] = read(base / rel)
    for rel in spec.get("envs") or []:
        data.update(_env_file(base / rel))
    unknown = set(spec) - {"name", "literals", "files", "envs", "options", "type", "behavior"}
    if unknown or spec.get("behavior", "create") != "create":
        raise RenderError(f"{kind}Generator {spec.get('name')}: unsupported {sorted(unknown) or 'behavior'}")
    opts = {**options, **(spec.get("options") or {})}
    meta: Obj = {"name": spec["name"]}
    if opts.get("labels"):
        meta["labels"] = dict(opts["labels"])
    if opts.get("annotations"):
        meta["annotations"] = dict(opts["annotations"])
    obj: Obj = {"apiVersion": "v1", "kind": kind, "metadata": meta}
    if kind == "Secret":
        obj["type"] = spec.get("type", "Opaque")
        obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in sorted(data.items())}
    else:
        obj["data"] = dict(sorted(data.items()))
    if not opts.get("disableNameSuffixHash"):
        digest = hashlib.sha256(json.dumps([kind, obj.get("type"), obj["data"]], sort_keys=True).encode())
        meta["name"] = f"{spec['name']}-{digest.hexdigest()[:10]}"
    return obj


_REF_FIELDS = {
    "ConfigMap": {"configMapKeyRef": "name", "configMapRef": "name", "configMap": "name"},
    "Secret": {"secretKeyRef": "name", "secretRef": "name", "secret": "secretName"},
}


def rewrite_references(objects: list[Obj], generated: dict[tuple[str, str], str]) -> None:
    """Point every ConfigMap/Secret reference at the generated (hash-suffixed) name."""

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for kind, fields in _REF_FIELDS.items():
                for key, name_field in fields.items():
                    ref = node.get(key)
                    if isinstance(ref, dict) and (kind, ref.get(name_field)) in generated:
                        ref[name_field] = generated[(kind, ref[name_field])]
            if isinstance(node.get("imagePullSecrets"), list):
                for ref in node["imagePullSecrets"]:
                    if ("Secret", ref.get("name")) in generated:
                        ref["name"] = generated[("Secret", ref["name"])]
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    for o in objects:
        if o.get("kind") not in ("ConfigMap", "Secret"):
            visit(o)


# -- the kustomization ---------------------------------------------------------------------------------------------------


def _kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return directory / name
    raise RenderError(f"{directory}: no kustomization.yaml")


def _apply_patch(objects: list[Obj], patch: Any, target: Obj | None, where: str) -> None:
    if isinstance(patch, list):
        if target is None:
            raise RenderError(f"{where}: a JSON 6902 patch needs a target")
        hits = [i for i, o in enumerate(objects) if _target_matches(o, target)]
        for i in hits:
            objects[i] = json6902(objects[i], patch)
    elif isinstance(patch, dict):
        if target is None:
            meta = patch.get("metadata") or {}
            target = {"kind": patch.get("kind"), "name": re.escape(str(meta.get("name")))}
            if meta.get("namespace"):
                target["namespace"] = re.escape(str(meta["namespace"]))
        hits = [i for i, o in enumerate(objects) if _target_matches(o, target)]
        body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind", "metadata")}
        extra_meta = {
            k: v for k, v in (patch.get("metadata") or {}).items() if k in ("labels", "annotations")
        }
        if extra_meta:
            body["metadata"] = extra_meta
        for i in hits:
            objects[i] = strategic_merge(objects[i], body)
    else:
        raise RenderError(f"{where}: a patch is a mapping (strategic merge) or a list (JSON 6902)")
    if not hits:
        raise RenderError(f"{where}: patch target {target} matches no object")


def render_dir(directory: Path) -> Rendered:
    directory = Path(directory)
    kfile = _kustomization_file(directory)
    docs = load_docs(kfile)
    k: Obj = docs[0] if docs else {}
    unknown = set(k) - SUPPORTED_KEYS
    if unknown:
        raise RenderError(f"{kfile}: keys not supported by deploy/render.py: {sorted(unknown)}")

    objects: list[Obj] = []
    generated: dict[tuple[str, str], str] = {}
    for entry in k.get("resources") or []:
        path = directory / str(entry)
        if "://" in str(entry) or str(entry).startswith("github.com/"):
            raise RenderError(f"{kfile}: remote resource {entry!r} not supported")
        if path.is_dir():
            sub = render_dir(path)
            objects += sub.objects
            generated.update(sub.generated)
        else:
            for doc in load_docs(path):
                if not isinstance(doc, dict) or "kind" not in doc:
                    raise RenderError(f"{path}: not a Kubernetes object: {str(doc)[:80]}")
                objects.append(doc)

    options = k.get("generatorOptions") or {}
    for kind, key in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for spec in k.get(key) or []:
            obj = _generate(kind, spec, directory, options)
            objects.append(obj)
            generated[(kind, str(spec["name"]))] = obj["metadata"]["name"]

    for i, p in enumerate(k.get("patches") or []):
        where = f"{kfile}: patches[{i}]"
        if "path" in p:
            patch_docs = load_docs(directory / p["path"])
        elif "patch" in p:
            patch_docs = [d for d in yaml.safe_load_all(p["patch"]) if d is not None]
        else:
            raise RenderError(f"{where}: needs path or patch")
        if set(p) - {"path", "patch", "target"}:
            raise RenderError(f"{where}: unsupported keys {sorted(set(p) - {'path', 'patch', 'target'})}")
        for doc in patch_docs:
            _apply_patch(objects, doc, p.get("target"), where)

    if "namespace" in k:
        for o in objects:
            if o.get("kind") not in CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = k["namespace"]
            if o.get("kind") in ("RoleBinding", "ClusterRoleBinding"):
                for subject in o.get("subjects") or []:
                    if subject.get("kind") == "ServiceAccount":
                        subject["namespace"] = k["namespace"]
    if k.get("commonLabels"):
        add_labels(objects, dict(k["commonLabels"]), selectors=True, templates=True)
    for entry in k.get("labels") or []:
        selectors = bool(entry.get("includeSelectors"))
        add_labels(objects, dict(entry.get("pairs") or {}), selectors, bool(entry.get("includeTemplates")))
    if k.get("images"):
        set_images(objects, list(k["images"]))
    for rep in k.get("replicas") or []:
        hits = [o for o in objects if o.get("kind") in WORKLOADS and o["metadata"]["name"] == rep["name"]]
        if not hits:
            raise RenderError(f"{kfile}: replicas for unknown workload {rep['name']!r}")
        for o in hits:
            o["spec"]["replicas"] = int(rep["count"])

    rewrite_references(objects, generated)
    seen: set[tuple[str, str, str]] = set()
    for o in objects:
        if obj_id(o) in seen:
            raise RenderError(f"{kfile}: two objects with id {obj_id(o)}")
        seen.add(obj_id(o))
    return Rendered(objects, generated)


def render(directory: str | Path) -> list[Obj]:
    """The objects ``kubectl kustomize DIRECTORY`` would print (in kustomize's legacy kind order)."""
    objects = render_dir(Path(directory)).objects

    def order(o: Obj) -> tuple[int, str, str]:
        kind = str(o.get("kind"))
        rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
        return (rank, kind, str((o.get("metadata") or {}).get("name")))

    return sorted(objects, key=order)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python deploy/render.py KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(dump(render(argv[0])))
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
