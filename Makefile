# The two commands of the README's Quickstart. Each does its own set-up (scripts/setup.sh, idempotent).
.PHONY: setup native demo test test-lmcache lint test-fast faults soak gpu-check

setup:
	bash scripts/setup.sh

# The proxy's request path compiled with mypyc (scripts/setup.sh runs it when a listed source changed).
native:
	.venv/bin/python scripts/build_native.py

demo: setup
	.venv/bin/vllm-disagg demo

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python scripts/build_native.py --typecheck  # mypy over the installed layout (vllm_disagg.router.*)

# VLLM_DISAGG_REQUIRE_NATIVE: the suite fails (test_native.py) if the compiled request path is not what it runs.
test: lint
	VLLM_DISAGG_REQUIRE_NATIVE=1 .venv/bin/pytest -x -q
	$(MAKE) test-lmcache

# The LMCache tier's tests run in their own venv (lmcache downgrades numpy and pulls cupy): docs/lmcache.md.
test-lmcache:
	bash scripts/setup-lmcache.sh
	.venv-lmcache/bin/pytest -x -q tests/e2e/test_lmcache_tier.py tests/unit/test_tiered_connector.py

# Unit tests only (no vLLM processes).
test-fast: setup
	.venv/bin/pytest -q -m "not vllm and not soak"

faults: setup
	.venv/bin/pytest -q -s -m faults tests/e2e/test_fault_matrix.py

soak: setup
	.venv/bin/pytest -q -m soak

# The prepared check for a lent GPU machine (docs/gpu-check.md): torch + CUDA there, no .venv, no network;
# GPU_CHECK_ARGS passes options, e.g. GPU_CHECK_ARGS="--wheels /path/to/wheels --json /path/to/results.json".
gpu-check:
	$(if $(wildcard .venv/bin/python),.venv/bin/python,python3) scripts/gpu_check.py $(GPU_CHECK_ARGS)
