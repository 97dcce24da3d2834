#!/bin/bash
# The frontend's own cost, this tree's against a commit's: the OpenAI frontend of BEFORE (a
# commit) and of this tree, each one process, on their own ports in front of one worker on the
# synthetic fake engine (bench.synthetic_worker: no model, so the frontend is the bottleneck),
# loaded over HTTP by bench.worker_processes from its own load process; ROUNDS alternating
# rounds with the order rotated.
#   BEFORE=c3250b6 ROUNDS=3 bash bench/frontend_vs_commit.sh
# CONCURRENCY (32), MAX_TOKENS (128), REQUESTS (per stream, 2), REPEATS (2) and LOGPROBS
# (off,5) shape the load: CONCURRENCY=256 MAX_TOKENS=4 REQUESTS=8 weighs the admission of
# waves of requests. Each load also prints the frontend process's CPU per 1,000 output tokens
# (bench.cpu_cost), steadier than tok/s on a noisy host. Labels fe-before-r<K> /
# fe-after-r<K>; ratios: python -m bench.worker_processes --compare fe-before,fe-after
# --to fe-before --rounds r1,r2,r3
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
BEFORE=${BEFORE:-c3250b6}
AFTER=${AFTER:-$PWD}
SUBJECT=bench.synthetic.generate
MODEL=$($PY -c "from worker.dev.tiny_model import ensure_tiny_model; print(ensure_tiny_model())")
LOG=$(mktemp -d)
OLD=$LOG/before
git worktree add -q --detach "$OLD" "$BEFORE"
cleanup() { kill $(jobs -p) 2>/dev/null; wait; git worktree remove --force "$OLD"; }
trap cleanup EXIT
# SIGTERM (the cleanup's kill) leaves the with block, which stops the nats-server it started.
$PY -c "
from worker.dev.embedded import NatsServer
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with NatsServer() as s:
    print(s.url, flush=True); signal.pause()
" > "$LOG/nats.url" 2>/dev/null &
until [ -s "$LOG/nats.url" ]; do sleep 0.2; done
URL=$(head -1 "$LOG/nats.url")
$PY -m bench.synthetic_worker "$URL" --subject $SUBJECT > "$LOG/worker.log" 2>&1 &
until grep -qs ready "$LOG/worker.log"; do sleep 0.2; done
declare -A PID
start_frontend() {  # start_frontend <tree> <port>
  (cd "$1" && PYTHONPATH="$1" exec $PY -m worker.frontend --nats-url "$URL" --model "$MODEL" \
    --subject $SUBJECT --host 127.0.0.1 --port "$2" --log-level warning) > "$LOG/fe-$2.log" 2>&1 &
  PID[$2]=$!
  until curl -sf "http://127.0.0.1:$2/v1/models" > /dev/null; do sleep 0.3; done
}
start_frontend "$OLD" 18101
start_frontend "$AFTER" 18102
for round in $(seq "${ROUNDS:-3}"); do
  sides="before after"; [ $((round % 2)) = 0 ] && sides="after before"
  for side in $sides; do
    port=18101; [ $side = after ] && port=18102
    $PY -m bench.worker_processes --nats-url "$URL" --openai-url "http://127.0.0.1:$port/v1" \
      --model "$MODEL" \
      --label "fe-$side-r$round" --concurrency "${CONCURRENCY:-32}" \
      --max-tokens "${MAX_TOKENS:-128}" --requests-per-stream "${REQUESTS:-2}" \
      --repeats "${REPEATS:-2}" --logprobs "${LOGPROBS:-off,5}" \
      --vocab 1024 --cpu-of "frontend=${PID[$port]}" | grep -E "tok/s|^\| frontend"
  done
done
labels=$(for r in $(seq "${ROUNDS:-3}"); do printf "r%s," "$r"; done)
$PY -m bench.worker_processes --compare fe-before,fe-after --to fe-before --rounds "${labels%,}"
