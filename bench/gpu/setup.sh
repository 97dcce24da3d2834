#!/bin/bash
# Device call 8 of the GPU run (after the seven chunk calls; see bench/gpu/README.md): install the
# bundle's wheels to /tmp/site, check that this checkout's vLLM-facing imports work against the
# device's vLLM, and build the ~1B random Llama on the GPU (SIZES="1b 8b": the ~8B one too).
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d /tmp/site/vllm ]; then
  cat /tmp/asm/c* | tar xf - -C /tmp
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheels/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  nats-server --version
  python3 -c "import worker.engine.vllm_adapter, worker.cli, worker.engine.scaleout; from vllm.logprobs import FlatLogprobs; print('worker imports ok; FlatLogprobs', sorted(FlatLogprobs.__dataclass_fields__))"
} 2>&1 | tee "$OUT/setup.txt"
# SIZES="1b 8b" (or "8b") also builds Llama-3-8B's shape in /tmp/llama-8b (multi-GPU, ~15 GB).
for size in ${SIZES:-1b}; do
  [ -f "/tmp/llama-$size/config.json" ] || python3 -m bench.gpu.build_model "/tmp/llama-$size" \
    --size "$size" 2>&1 | tail -3 | tee -a "$OUT/setup.txt"
done
