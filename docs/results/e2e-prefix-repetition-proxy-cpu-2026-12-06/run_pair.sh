#!/bin/bash
cd "$(git rev-parse --show-toplevel)"
design=$1; out=$2
mkdir -p $out
.venv/bin/python benchmarks/e2e.py --designs $design --datasets prefix-repetition --rates 24 --repeats 1 --num-prompts 300 --slo "ttft:1500 tpot:25" --out $out > $out/e2e.log 2>&1 &
E2E=$!
for i in $(seq 1 900); do pgrep -f "bench serve" >/dev/null && break; sleep 0.5; done   # warm-up
for i in $(seq 1 900); do pgrep -f "bench serve" >/dev/null || break; sleep 0.2; done   # warm-up done
for i in $(seq 1 900); do pgrep -f "bench serve" >/dev/null && break; sleep 0.2; done   # the point
P=$(pgrep -f "vllm_disagg.cli proxy" | head -1)
echo "proxy pid $P at $(date +%T)" >> $out/e2e.log
.venv/bin/py-spy record --pid $P --format raw --rate 250 --duration 30 --nonblocking -o $out/proxy.raw >> $out/pyspy.log 2>&1
wait $E2E
