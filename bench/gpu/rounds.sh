#!/bin/bash
# Several sides of bench/gpu/worker_processes.sh one after the other in one device call, each
# alone on the GPU (the script stops what ran before), for alternating rounds within one lease:
#   ROUND=r2 SIDES="serve1 serve4 stack" bash bench/gpu/rounds.sh
# Sides: stack (the OpenAI stack with no process flags, N=auto P=auto), stacknokv (the same
# with --no-kv-events and --router queue), stackpin (the same with the engine core on cores
# 0-1, everything else on the others; stackpin4: cores 0-3; stackecK: the worker's own
# --engine-core-cpus for worker_processes.sh's entry K), stackpins and serveApins (one
# engine start, the loads once per placement in PINS), stackNP (--worker-processes N,
# --processes P), stackmbtT and serveAmbtT (--max-num-batched-tokens T on the stack's worker
# or on vllm serve), serveA (vllm serve --api-server-count A), nN (the worker alone,
# --worker-processes N), ceiling (CEILING_ARGS and TAG as worker_processes.sh reads them).
# REPEATS (default 1) and CONCURRENCIES (default "256 32") apply to every side;
# each side's output goes to $OUT/<side>-<round>.txt and its headline lines to stdout.
# BUDGET_S (default 540, inside a device call's 600 s): a side runs under what is left of it
# and is skipped with under a minute left, so the call always reaches the packing at the end.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export OUT REPEATS=${REPEATS:-1} CONCURRENCIES=${CONCURRENCIES:-256 32} ROUND=${ROUND:-}
start=$(date +%s)
for side in ${SIDES:?SIDES names the sides}; do
  case "$side" in
    stack) vars=(SIDE=stack N=auto P=auto) ;;
    # The stack at its defaults but with no KV events (the engine core's publisher thread
    # off) and so the queue group: is the engine core's slower step beside the stack the events?
    stacknokv) vars=(SIDE=stack N=auto P=auto TAG=-nokv WORKER_ARGS=--no-kv-events
      "FRONTEND_ARGS=--router queue") ;;
    # The stack at its defaults with the engine core on cores of its own (PIN=1): does it
    # step slower beside the stack because the stack's processes share its cores? (P=4: the
    # frontend's auto would count the 14 cores left, 3)
    stackpin) vars=(SIDE=stack N=auto P=4 TAG=-pin PIN=1) ;;
    # The same with four cores for the engine core: two were too few for its threads at 32
    # streams on 2026-12-07 (its step 6-10% slower there, while faster at 256).
    stackpin4) vars=(SIDE=stack N=auto P=4 TAG=-pin4 PIN=1 PIN_CORES=4) ;;
    # One engine start, the loads once per PINS entry (default 0 2 4 0), the processes moved
    # between them (worker_processes.sh, PINS): each placement against the others on one start.
    stackpins) vars=(SIDE=stack N=auto P=auto TAG=-sweep "PINS=${PINS:-0 2 4 0}") ;;
    serve[1-9]pins) vars=(SIDE=serve "API=${side:5:1}" TAG=-sweep "PINS=${PINS:-0 2 4 0}") ;;
    # The stack whose worker places its own engine core (--engine-core-cpus with split's cores
    # for the entry after "stackec": stackecs1, stackec2), the frontend (P=4, as auto would
    # count every core) and the load on the rest: the product's flag, not taskset from outside.
    stackec*) vars=(SIDE=stack N=auto P=4 "TAG=-ec${side#stackec}" "ENGINE_CORE=${side#stackec}") ;;
    # The first token at 256 streams waits for a wave of up to 256 prompts prefilled in one
    # step of the engine's 8,192 batched tokens: the same stack and vllm serve with a smaller
    # --max-num-batched-tokens (stackmbt2048, serve1mbt2048; the ceiling: CEILING_ARGS).
    stackmbt*) vars=(SIDE=stack N=auto P=auto "TAG=-mbt${side#stackmbt}"
      "WORKER_ARGS=--max-num-batched-tokens ${side#stackmbt}") ;;
    serve[1-9]mbt*) vars=(SIDE=serve "API=${side:5:1}" "TAG=-mbt${side#serve[1-9]mbt}"
      "SERVE_ARGS=--max-num-batched-tokens ${side#serve[1-9]mbt}") ;;
    # The stack with N worker and P frontend processes given (stack22: two and two): does the
    # engine core step faster beside fewer busy processes?
    stack[1-9][1-9]) vars=(SIDE=stack "N=${side:5:1}" "P=${side:6:1}") ;;
    serve*) vars=(SIDE=serve "API=${side#serve}") ;;
    n*) vars=(SIDE=worker "N=${side#n}") ;;
    ceiling) vars=(SIDE=ceiling) ;;
    *) echo "unknown side $side"; exit 2 ;;
  esac
  left=$(( ${BUDGET_S:-540} - ($(date +%s) - start) ))
  if [ "$left" -lt 60 ]; then echo "== $side ${ROUND:-}: skipped, ${left} s of the budget left"; continue; fi
  timeout -k 10 "$left" env "${vars[@]}" bash bench/gpu/worker_processes.sh \
    > "$OUT/$side-${ROUND:-once}.txt" 2>&1
  code=$?
  echo "== $side ${ROUND:-}"
  if [ "$code" = 124 ]; then
    echo "stopped at the budget (${left} s)"
    pkill -f "^python3 -m worker"; pkill -f "vllm serve"; pkill nats-server
  fi
  grep -E "ready after| tok/s|did not|died|exit [1-9]" "$OUT/$side-${ROUND:-once}.txt"
  grep -A6 "after the first token" "$OUT/$side-${ROUND:-once}.txt" | grep -E "engine core: decode|client loop|worker's frames|the load"
done
# The device returns a few files per call: everything this call wrote under $OUT goes back as
# one archive (PACK=0 leaves the files as they are).
if [ "${PACK:-1}" = 1 ]; then
  pack="rounds-${ROUND:-once}-$(date +%H%M%S).tgz"
  (cd "$OUT" && find . -maxdepth 1 -type f ! -name '*.tgz' -printf '%P\n' | tar czf "$pack" -T - \
    && find . -maxdepth 1 -type f ! -name '*.tgz' -delete)
  echo "packed: $OUT/$pack"
fi
