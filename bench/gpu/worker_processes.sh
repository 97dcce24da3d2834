#!/bin/bash
# One side of the worker-processes comparison per device call (tok/s and TTFT at 256 streams of
# the engine ceiling, vllm serve, the worker with N processes, the OpenAI stack), each with the
# GPU to itself (the side before is stopped first): 256 streams x 2 requests x 128 tokens,
# 32-token prompts, logprobs off/5/20, REPEATS runs each, driven by bench.worker_processes from a
# load process of its own; JSON (side_<label>.json) and logs under $OUT.
#   SIDE=ceiling bash bench/gpu/worker_processes.sh         offline LLM.generate (bench.ceiling)
#   ... CEILING_ARGS="--max-num-seqs 256" TAG=-seq256: more engine flags for the ceiling alone
#       (that one: no more requests in the batch than the online sides have streams)
#   SIDE=serve API=4 bash bench/gpu/worker_processes.sh     vllm serve --api-server-count 4
#   SIDE=worker N=2 bash bench/gpu/worker_processes.sh      the worker, --worker-processes 2
#   SIDE=stack N=4 P=4 bash bench/gpu/worker_processes.sh   the OpenAI stack: the worker (N
#       processes) behind `python -m worker.frontend --processes P`, loaded over HTTP as vllm
#       serve is; N=auto P=auto: neither flag given (the defaults), N read from the worker's
#       `--worker-processes auto: N` line
#   ... PROFILE=1: also py-spy during one run at PROFILE_LOGPROBS (20 for SIDE=worker, off for
#   SIDE=stack) on worker process 0, and with SIDE=stack on one frontend process at the same
#   time, with `top` snapshots of every process; needs py-spy's wheel in .gpu/, carried with
#   the call
#   WORKER_ARGS="--stream-interval 4" FRONTEND_ARGS="--router queue" TAG=-si4: more worker or
#   frontend flags, and a tag for the label; SERVE_ARGS: more vllm serve flags (WORKER_ARGS
#   reaches the worker only: an eager comparison passes --enforce-eager in both)
#   PROFILE=core (SIDE=worker): py-spy on the engine core process instead, at PROFILE_LOGPROBS
#   (default off), for where the engine's own loop spends its time without logprobs
#   ROUTERS="kv queue" (SIDE=stack): one frontend per router mode in turn on the same worker
#   NATS=1 (SIDE=stack): then, the frontend stopped, the same worker loaded over NATS as n<N>,
#   so one engine start measures both
#   CONCURRENCY=32 TAG=-c32: another number of streams than 256
#   CONCURRENCIES="256 32": each in turn on the same start, the 32-stream labels tagged -c32
#   PIN=1: the engine core alone on cores 0-1 (all its threads, moved once it is up) and every
#   other process of the side, nats-server and the load included, on cores 2 and up: does the
#   engine core step faster with cores of its own? PIN_CORES=4: cores 0-3 for it, the rest 4 up;
#   PIN_CORES=s2: two physical cores with their hyperthreads (PINS' entries below)
#   ENGINE_CORE=s1 (SIDE=worker or stack): the same placement made by the worker itself
#   (`--engine-core-cpus` with the entry's cores; nats-server, the frontend and the load on the
#   rest), label tagged by TAG
#   PINS="0 2 4 0" (SIDE=stack or serve): the loads once per entry on one engine start, the
#   side's processes moved between entries: 0 every process on every core, K the engine core on
#   cores 0..K-1 and the rest (the load too) on K and up, sK the engine core on the first K
#   physical cores, each with all its hyperthreads; labels tagged -pin<entry> (-pin0 for 0)
#   ROUND=r1: appended to the side's label (side_serve4-r1.json, …), for alternating rounds that
#   `python -m bench.worker_processes --rounds r1,r2,r3 --compare … --to …` sets side by side
set -uo pipefail
OUT=${OUT:-/tmp/out}
SIDE=${SIDE:-worker}
N=${N:-1}
P=${P:-4}
API=${API:-4}
REPEATS=${REPEATS:-3}
ROUND=${ROUND:+-$ROUND}
TAG=${TAG:-}
read -r -a WORKER_ARGS <<< "${WORKER_ARGS:-}"
read -r -a FRONTEND_ARGS <<< "${FRONTEND_ARGS:-}"
read -r -a CEILING_ARGS <<< "${CEILING_ARGS:-}"
read -r -a SERVE_ARGS <<< "${SERVE_ARGS:-}"
mkdir -p "$OUT"
PIN=${PIN:-0} PIN_CORES=${PIN_CORES:-2}
# split <entry>: "<the engine core's cores> <everyone else's>" as cpu lists: K (a number) cores
# 0..K-1; sK the first K physical cores with all their hyperthreads (siblings from sysfs), so
# that nothing else runs on a physical core of the engine core's.
split() {
  python3 - "$1" <<'PY'
import os, sys

from worker.engine.placement import cpu_list

def siblings(c):
    return cpu_list(open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read())

entry, n = sys.argv[1], os.cpu_count() or 1
engine = set(range(int(entry))) if entry.isdigit() else set()
physical = int(entry[1:]) if entry.startswith("s") else 0
for c in range(n):
    if physical == 0:
        break
    if c not in engine:
        engine |= siblings(c)
        physical -= 1
print(",".join(map(str, sorted(engine))) or "-", ",".join(str(c) for c in range(n) if c not in engine))
PY
}
pin=(); [ "$PIN" = 1 ] && read -r _ rest <<< "$(split "$PIN_CORES")" && pin=(taskset -c "$rest")
# ENGINE_CORE=<entry> (SIDE=worker or stack): the worker's own `--engine-core-cpus` with split's
# cores for the entry, the worker started on every core (it places its engine core and its
# processes itself) and everything else (nats-server, the frontend, the load) on the rest:
# the product's placement, where PIN=1 and PINS move the processes from outside.
wpin=()
if [ -n "${ENGINE_CORE:-}" ]; then
  read -r engine_cpus rest <<< "$(split "$ENGINE_CORE")"
  WORKER_ARGS+=(--engine-core-cpus "$engine_cpus")
  pin=(taskset -c "$rest")
  echo "--engine-core-cpus $engine_cpus (entry $ENGINE_CORE), the rest on $rest"
else
  wpin=("${pin[@]}")
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
ENGINE=(--dtype bfloat16 --max-model-len 2048 --max-logprobs 20
        --kv-cache-memory-bytes 16000000000 --seed 0)
MODEL=/tmp/llama-1b
# The worker's Prometheus endpoint, read before and after each setting's runs: the load's table
# then says where the first token waits (bench.first_token).
METRICS=(--metrics-port 9090 --metrics-host 127.0.0.1)
WAITS=(--metrics-url http://127.0.0.1:9090/metrics)
# NO_METRICS=1: neither (the worker with no metrics port, as before the first-token table).
[ "${NO_METRICS:-0}" = 1 ] && METRICS=() && WAITS=()
pkill -f "^python3 -m worker" ; pkill -f "vllm serve"; sleep 2
pkill nats-server; "${pin[@]}" nats-server -a 127.0.0.1 -p 4222 > "$OUT/nats.log" 2>&1 &
nats_pid=$!
sleep 1
started=$(date +%s)

wait_for() {  # wait_for <log> <pattern> <count> <pid>
  until [ "$(grep -c "$2" "$1")" -ge "$3" ]; do
    if ! kill -0 "$4" 2>/dev/null || [ $(( $(date +%s) - started )) -gt 420 ]; then
      echo "$SIDE did not get ready"; tail -30 "$1"; return 1
    fi
    sleep 2
  done
  echo "$SIDE ready after $(( $(date +%s) - started )) s"
}

load() {  # load <label> [worker_processes args]: one bench run per concurrency (CONCURRENCIES,
  # default: CONCURRENCY or 256), its JSON kept, its table printed; a concurrency other than 256
  # is tagged -c<C> before the round (stackautoauto-c32-r1)
  local label=$1 c l; shift
  for c in ${CONCURRENCIES:-${CONCURRENCY:-256}}; do
    l=$label; [ "$c" != 256 ] && [ -z "${CONCURRENCY:-}" ] && l=${label%"$ROUND"}-c$c$ROUND
    # The host's CPU while it runs (TOP=0: not): whether the engine core shares its cores
    # with the side's other processes (the stack's engine core stepped slower than vllm
    # serve's on 2026-12-07, with the same engine arguments).
    local topper=
    if [ "${TOP:-1}" = 1 ]; then
      (top -b -d 5 -w 220 -c | grep --line-buffered -E "^top|^%Cpu|python|vllm|VLLM|nats-server" \
        > "$OUT/top-$l.txt") &
      topper=$!
    fi
    # CPU_OF (name=pid,...: the side's process trees, set by each side below): CPU per token
    # of each, the engine core apart (bench.cpu_cost).
    local cpu_of=(); [ -n "${CPU_OF:-}" ] && cpu_of=(--cpu-of "$CPU_OF")
    timeout "${BENCH_TIMEOUT:-300}" "${pin[@]}" python3 -m bench.worker_processes --label "$l" \
      --repeats "$REPEATS" --concurrency "$c" "${cpu_of[@]}" "$@" > "$OUT/side-$l.txt" 2>&1
    echo "bench exit $?"
    if [ -n "$topper" ]; then pkill -P "$topper"; wait "$topper" 2>/dev/null; fi
    cp "bench/out/side_$l.json" "$OUT/" 2>/dev/null
    grep -E "logprobs=.* tok/s|warm-up" "$OUT/side-$l.txt"
    grep -A10 "where the first token waits" "$OUT/side-$l.txt"
    grep -A5 "after the first token" "$OUT/side-$l.txt"
    grep -A8 "^CPU per 1,000" "$OUT/side-$l.txt"
  done
}

profiled() {  # profiled <label> <pid>... -- [worker_processes args]: py-spy on each pid, 25 s at
  # 200 Hz (raw collapsed stacks), and `top` every 5 s, during one run of 3 repeats
  local label=$1 pid spies=() n=0; shift
  [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .gpu/py_spy-*.whl
  while [ "$1" != -- ]; do
    timeout 120 /tmp/pyspy/bin/py-spy record --pid "$1" --rate 200 --duration 25 --format raw "${SPY[@]}" \
      --output "$OUT/profile-$label-$n.txt" > "$OUT/pyspy-$label-$n.log" 2>&1 &
    spies+=($!); n=$((n + 1)); shift
  done
  shift
  top -b -d 5 -n 5 -w 200 -c | grep -E "^top|python|vllm|VLLM|nats-server" > "$OUT/top-$label.txt" &
  sleep 1
  python3 -m bench.worker_processes --label "$label-profiled" --repeats 3 \
    --logprobs "${PROFILE_LOGPROBS:-$1}" "${@:2}" > "$OUT/side-$label-profiled.txt" 2>&1
  for pid in "${spies[@]}"; do wait "$pid"; echo "py-spy exit $?"; done
  tail -2 "$OUT/side-$label-profiled.txt"
}

SPY=()  # more py-spy flags for profiled()
# PROFILE=core on the serve and stack sides: the engine core sampled (without pausing it) during
# one 3-repeat run at PROFILE_LOGPROBS (off) and PROFILE_CONCURRENCY (32) streams, before the
# side's loads: where does its step go beside each side's other processes?
core_profile() {  # core_profile <label> [worker_processes args]
  [ "${PROFILE:-0}" = core ] || return 0
  local label=$1; shift
  SPY=(--nonblocking)
  profiled "$label-core" "$(core)" -- "${PROFILE_LOGPROBS:-off}" "$@" \
    --concurrency "${PROFILE_CONCURRENCY:-32}"
  SPY=()
}
# Process 0 of a `--worker-processes`/`--processes` parent (spawned children; not Python's
# resource tracker), or the parent itself when it has none.
child() { local c; c=$(pgrep -f spawn_main -P "$1" | head -1); echo "${c:-$1}"; }
# The engine core process (vLLM titles it VLLM::EngineCore via setproctitle).
core() { pgrep -f EngineCore | head -1; }
# PIN=1: the engine core's threads onto PIN_CORES (split's entry: 2, cores 0-1), once it runs
# (it inherited the others' set); the line names each of its cores' hyperthread siblings, which
# decide whether the engine core shares a physical core with the others.
pin_core() {
  [ "$PIN" = 1 ] || return 0
  local pid cpus siblings=() c; pid=$(core); read -r cpus _ <<< "$(split "$PIN_CORES")"
  for c in ${cpus//,/ }; do
    siblings+=("$c:$(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null)")
  done
  taskset -a -cp "$cpus" "$pid" > /dev/null \
    && echo "engine core $pid pinned to cores $cpus (core:siblings ${siblings[*]})"
}

# The processes under each pid given, themselves included.
tree() { local p; for p in "$@"; do echo "$p"; tree $(pgrep -P "$p"); done; }
# place <entry> <pid>...: every thread of the processes under the pids (nats-server among
# them) on the cores `split` leaves the others and the engine core's on its own; 0: every core
# for all. The loads that follow run on the same cores as the side (`pin`).
place() {
  local k=$1 engine rest p; shift
  read -r engine rest <<< "$(split "$k")"
  [ "$k" = 0 ] && rest=0-$(( $(nproc) - 1 ))
  for p in $(tree "$@"); do taskset -a -cp "$rest" "$p" > /dev/null 2>&1; done
  pin=(); [ "$k" != 0 ] && pin=(taskset -c "$rest")
  if [ "$k" != 0 ]; then PIN=1 PIN_CORES=$k pin_core; else echo "placed: every core for all"; fi
}
# sweep <label> <pids> [load args]: the loads once per PINS entry, each placed by `place` and
# labelled <label>-pin<entry> (a second 0: pin0b); an entry that gives the engine core the same cores as an earlier
# one but 0 (s2 where cores 0-3 are two physical cores) is skipped. Without PINS, the loads once,
# as placed at the start.
sweep() {
  local label=$1 pids=$2 k cores tag seen=" "; shift 2
  if [ -z "${PINS:-}" ]; then load "$label" "$@"; return; fi
  for k in $PINS; do
    read -r cores _ <<< "$(split "$k")"
    if [ "$k" != 0 ] && [[ "$seen" == *" $cores "* ]]; then
      echo "PINS $k: cores $cores as before, skipped"; continue
    fi
    # The second 0 (the drift check) is labelled pin0b, not over the first's JSON.
    tag=pin$k; [[ "$seen" == *" $cores "* ]] && tag=${tag}b
    seen+="$cores "
    # shellcheck disable=SC2086 # pids is a list
    place "$k" $pids
    load "${label%"$ROUND"}-$tag$ROUND" "$@"
  done
}

case "$SIDE" in
  ceiling)
    label=ceiling$TAG$ROUND
    timeout "${BENCH_TIMEOUT:-540}" python3 -m bench.ceiling --label "$label" --repeats "$REPEATS" \
      -- --model "$MODEL" "${ENGINE[@]}" "${CEILING_ARGS[@]}" > "$OUT/$label.log" 2>&1
    echo "bench exit $?"; grep "^$label logprobs" "$OUT/$label.log"
    cp "bench/out/side_$label.json" "$OUT/" 2>/dev/null
    ;;
  serve)
    label=serve$API$TAG$ROUND
    # No access log line per request, as the frontend runs (--log-level warning).
    "${pin[@]}" vllm serve "$MODEL" "${ENGINE[@]}" "${SERVE_ARGS[@]}" --api-server-count "$API" \
      --host 127.0.0.1 --port 8000 --disable-uvicorn-access-log > "$OUT/$label.log" 2>&1 &
    server=$!
    until curl -sf http://127.0.0.1:8000/v1/models > /dev/null; do
      if ! kill -0 $server 2>/dev/null || [ $(( $(date +%s) - started )) -gt 420 ]; then
        echo "$label did not get ready"; tail -30 "$OUT/$label.log"; exit 1
      fi
      sleep 2
    done
    echo "$label ready after $(( $(date +%s) - started )) s"
    pin_core
    # vllm serve's own /metrics: the same engine histograms, no worker (NO_METRICS=1: none).
    serve_waits=(--metrics-url http://127.0.0.1:8000/metrics)
    [ "${NO_METRICS:-0}" = 1 ] && serve_waits=()
    core_profile "$label" --openai-url http://127.0.0.1:8000/v1 --model "$MODEL"
    CPU_OF=serve=$server
    sweep "$label" "$server $nats_pid" --openai-url http://127.0.0.1:8000/v1 --model "$MODEL" \
      "${serve_waits[@]}"
    kill -TERM $server; wait $server; echo "server exit $?"
    ;;
  worker)
    label=n$N$TAG$ROUND
    "${wpin[@]}" python3 -m worker --nats-url nats://127.0.0.1:4222 --worker-processes "$N" --model "$MODEL" \
      "${ENGINE[@]}" "${METRICS[@]}" "${WORKER_ARGS[@]}" > "$OUT/worker-$label.log" 2>&1 &
    worker=$!
    wait_for "$OUT/worker-$label.log" "vllm-nats-worker ready" "$N" $worker || exit 1
    pin_core
    [ "${PROFILE:-0}" = 1 ] && profiled "$label" "$(child $worker)" -- 20
    # py-spy's default blocking samples pause the engine core often enough to cut its rate
    # about 4x, so the core is sampled without pausing it.
    if [ "${PROFILE:-0}" = core ]; then
      SPY=(--nonblocking)
      profiled "$label-core" "$(core)" -- "${PROFILE_LOGPROBS:-off}"
    fi
    CPU_OF=worker=$worker,nats=$nats_pid
    load "$label" "${WAITS[@]}"
    python3 -m bench.worker_stats
    kill -TERM $worker; wait $worker; echo "worker exit $?"
    grep -E "Error|error" "$OUT/worker-$label.log" | head -5
    ;;
  stack)
    label=stack$N$P$TAG$ROUND
    worker_flags=(--worker-processes "$N"); [ "$N" = auto ] && worker_flags=()
    frontend_flags=(--processes "$P"); [ "$P" = auto ] && frontend_flags=()
    "${wpin[@]}" python3 -m worker --nats-url nats://127.0.0.1:4222 "${worker_flags[@]}" --model "$MODEL" \
      "${ENGINE[@]}" "${METRICS[@]}" "${WORKER_ARGS[@]}" > "$OUT/worker-$label.log" 2>&1 &
    worker=$!
    count=$N
    if [ "$N" = auto ]; then
      until grep -q "worker-processes auto: " "$OUT/worker-$label.log"; do
        kill -0 $worker 2>/dev/null || { echo "worker died"; tail -30 "$OUT/worker-$label.log"; exit 1; }
        sleep 1
      done
      count=$(grep -o "worker-processes auto: [0-9]*" "$OUT/worker-$label.log" | head -1 | awk '{print $3}')
      echo "--worker-processes auto: $count"
    fi
    wait_for "$OUT/worker-$label.log" "vllm-nats-worker ready" "$count" $worker || exit 1
    pin_core
    # ROUTERS="kv queue": one frontend after the other on the same worker (one engine start),
    # each with `--router R`, labelled stack<N><P>-<R>; unset: one frontend, label stack<N><P>.
    for router in ${ROUTERS:-default}; do
      flabel=$label; router_args=()
      [ "$router" != default ] && flabel=stack$N$P$TAG-$router$ROUND && router_args=(--router "$router")
      "${pin[@]}" python3 -m worker.frontend --nats-url nats://127.0.0.1:4222 --model "$MODEL" \
        "${frontend_flags[@]}" --host 127.0.0.1 --port 8000 --log-level warning "${FRONTEND_ARGS[@]}" \
        "${router_args[@]}" > "$OUT/frontend-$flabel.log" 2>&1 &
      frontend=$!
      until curl -sf http://127.0.0.1:8000/v1/models > /dev/null; do
        if ! kill -0 $frontend 2>/dev/null; then
          echo "frontend did not start"; tail -30 "$OUT/frontend-$flabel.log"; exit 1
        fi
        sleep 1
      done
      openai=(--openai-url http://127.0.0.1:8000/v1 --model "$MODEL")
      # profile-<label>-0.txt: one frontend process (of P, reached through SO_REUSEPORT like
      # the others); -1: the worker's process 0.
      [ "${PROFILE:-0}" = 1 ] && profiled "$flabel" "$(child $frontend)" "$(child $worker)" -- off "${openai[@]}"
      core_profile "$flabel" "${openai[@]}"
      CPU_OF=worker=$worker,frontend=$frontend,nats=$nats_pid
      # The frontend's /metrics after the worker's: its first-SSE-event histogram splits the
      # frontend and NATS from the caller's side in the first-token table.
      stack_waits=(); [ ${#WAITS[@]} -gt 0 ] && stack_waits=(--metrics-url "${WAITS[1]},http://127.0.0.1:8000/metrics")
      sweep "$flabel" "$worker $frontend $nats_pid" "${openai[@]}" "${stack_waits[@]}"
      python3 -m bench.worker_stats
      # The router's picture (one frontend process's, the one that answers): routed-<label>.txt
      curl -s http://127.0.0.1:8000/metrics | grep -E "^nats_frontend_rout" > "$OUT/routed-$flabel.txt"
      kill -TERM $frontend; wait $frontend; echo "frontend exit $?"
    done
    if [ "${NATS:-0}" = 1 ]; then
      CPU_OF=worker=$worker,nats=$nats_pid
      load "n$N$TAG$ROUND" "${WAITS[@]}"
      python3 -m bench.worker_stats
    fi
    kill -TERM $worker; wait $worker; echo "worker exit $?"
    grep -E "Error|error" "$OUT/worker-$label.log" "$OUT"/frontend-*.log | head -5
    ;;
esac
pkill nats-server
