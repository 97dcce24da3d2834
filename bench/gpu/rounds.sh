#!/bin/bash
# Several sides of bench/gpu/worker_processes.sh one after the other in one device call, each
# alone on the GPU (the script stops what ran before), for alternating rounds within one lease:
#   ROUND=r2 SIDES="serve1 serve4 stack" bash bench/gpu/rounds.sh
# Sides: stack (the OpenAI stack with no process flags, N=auto P=auto), serveA (vllm serve
# --api-server-count A), nN (the worker alone, --worker-processes N), ceiling (CEILING_ARGS
# and TAG as worker_processes.sh reads them). REPEATS (default 1) and CONCURRENCIES (default
# "256 32") apply to every side; each side's output goes to $OUT/<side>-<round>.txt and its
# headline lines to stdout.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export OUT REPEATS=${REPEATS:-1} CONCURRENCIES=${CONCURRENCIES:-256 32} ROUND=${ROUND:-}
for side in ${SIDES:?SIDES names the sides}; do
  case "$side" in
    stack) env SIDE=stack N=auto P=auto bash bench/gpu/worker_processes.sh ;;
    serve*) env SIDE=serve API="${side#serve}" bash bench/gpu/worker_processes.sh ;;
    n*) env SIDE=worker N="${side#n}" bash bench/gpu/worker_processes.sh ;;
    ceiling) env SIDE=ceiling bash bench/gpu/worker_processes.sh ;;
    *) echo "unknown side $side"; exit 2 ;;
  esac > "$OUT/$side-${ROUND:-once}.txt" 2>&1
  echo "== $side ${ROUND:-}"
  grep -E "ready after| tok/s|did not|died|exit [1-9]" "$OUT/$side-${ROUND:-once}.txt"
  grep -A6 "after the first token" "$OUT/$side-${ROUND:-once}.txt" | grep -E "engine core: decode|client loop|worker's frames|the load"
done
