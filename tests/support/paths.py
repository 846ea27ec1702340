"""The repository's root, for tests that read its files or run its scripts."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLICIES = (
    ROOT / "tests" / "support" / "policies.py"
)  # test policies, loaded by the proxy with --policy FILE:Class
