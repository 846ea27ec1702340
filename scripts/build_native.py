"""Compile the proxy's request path with mypyc (``make native``; ``scripts/setup.sh`` runs it).

The proxy and its default policy are typed Python; mypyc turns the modules in ``NATIVE_MODULES``
(``vllm_disagg/native.py``) into C extensions that sit beside their sources, where an import finds them first.
Everything still runs from source when this step is skipped, fails (no C compiler), or a source changed after the
build: ``vllm_disagg/native.py`` checks each source's hash against the manifest written here and, on any mismatch,
loads every listed module from its ``.py`` instead (mixing the two is unsafe: compiled modules of one build call
each other directly).

The repo's layout installs ``router/`` as ``vllm_disagg.router``, so mypyc compiles from a staging tree of symlinks
with the installed layout (module names and cross-module types as they are at run time), and the built extensions
are copied back next to their sources.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_disagg.native import (  # noqa: E402
    GROUP,
    MANIFEST,
    NATIVE_MODULES,
    ext_suffix,
    extension_path,
    source_digest,
    stale,
)

BUILD = ROOT / ".artifacts" / "native-build"


class BuildFailed(RuntimeError):
    pass


def _stage() -> Path:
    """A tree with the installed layout: vllm_disagg/ holding links to the core's entries, router/, connectors/."""
    stage = BUILD / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    pkg = stage / "vllm_disagg"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "vllm_disagg").iterdir():
        if entry.name == "__pycache__" or entry.name.endswith(".so"):
            continue
        (pkg / entry.name).symlink_to(entry)
    (pkg / "router").symlink_to(ROOT / "router")
    (pkg / "connectors").symlink_to(ROOT / "connectors")
    return stage


def clean() -> None:
    """Remove every extension a build put beside the sources (those of modules listed before too: a shim left
    behind would load and fail to find its code in the new build), and the manifest."""
    for package in ("vllm_disagg", "router", "connectors"):
        for ext in (ROOT / package).rglob("*" + ext_suffix()):
            ext.unlink()
    MANIFEST.unlink(missing_ok=True)


def build() -> None:
    clean()
    stage = _stage()
    paths = [str(Path(*m.split(".")).with_suffix(".py")) for m in NATIVE_MODULES]
    driver = f"""
import sys
from setuptools import setup
from mypyc.build import mypycify
setup(
    name="vllm_disagg_native",
    ext_modules=mypycify({paths!r}, opt_level="3", group_name={GROUP!r}),
    script_args=["build_ext", "--build-lib", {str(BUILD / "lib")!r}, "--build-temp", {str(BUILD / "tmp")!r}],
)
"""
    started = time.monotonic()
    # the sources as compiled: hashed before the compiler reads them, so a source edited during the build's
    # minutes is stale in the manifest (and runs as Python) rather than passed off as compiled
    digests = {m: source_digest(m) for m in NATIVE_MODULES}
    verbose = bool(os.environ.get("VERBOSE"))
    run = subprocess.run(
        [sys.executable, "-c", driver],
        cwd=stage,
        stdout=None if verbose else subprocess.PIPE,
        stderr=None if verbose else subprocess.STDOUT,
        text=True,
    )
    if run.returncode != 0:
        # mypyc's type errors and the compiler's come on stdout: the last lines say what failed
        tail = "\n".join((run.stdout or "").splitlines()[-25:])
        raise BuildFailed(f"exit status {run.returncode}" + (f":\n{tail}" if tail else ""))
    for module in [*NATIVE_MODULES, GROUP + "__mypyc"]:
        target = extension_path(module)
        built = BUILD.joinpath("lib", *module.split(".")[:-1], target.name)  # the installed layout
        shutil.copy2(built, target)
    manifest = {
        "python": sysconfig.get_config_var("SOABI"),
        "modules": digests,
    }
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    edited = [m for m in NATIVE_MODULES if source_digest(m) != digests[m]]
    if edited:
        print(
            f"[native] edited during the build, so they run as Python until the next build: {', '.join(edited)}"
        )
    print(f"[native] compiled {len(NATIVE_MODULES)} modules with mypyc in {time.monotonic() - started:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clean", action="store_true", help="remove the compiled modules (run from source)")
    parser.add_argument(
        "--typecheck",
        action="store_true",
        help="run mypy over the installed layout instead (make lint): a plain `mypy` of the repo cannot follow "
        "`vllm_disagg.router.*` imports to router/ and reads them as Any",
    )
    parser.add_argument(
        "--if-stale", action="store_true", help="build only when a listed source changed since the last build"
    )
    args = parser.parse_args()
    if args.clean:
        clean()
        return 0
    if args.typecheck:
        cmd = [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "-p",
            "vllm_disagg",
        ]
        return subprocess.run(cmd, cwd=_stage()).returncode
    if args.if_stale and not stale():
        return 0
    try:
        build()
    except (BuildFailed, OSError) as exc:
        clean()
        print(
            f"[native] mypyc build failed ({exc})\n[native] the proxy runs from its Python source (correct, "
            "~1.6x the CPU a request); `make test` fails on this (tests/unit/test_native.py)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
