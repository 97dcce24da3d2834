"""A bigger random-weight Llama for the KV-routing benchmark (bench/kv_routing.py): the tiny
model's tokenizer and recipe (worker/dev/tiny_model.py), but wide and deep enough that prefill
is a visible share of TTFT on a CPU, and 4096 positions for long conversations. Seeded and
cached beside the tiny model, under its own name.

    python -m bench.kv_model [--hidden 512 --layers 4]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from worker.dev import tiny_model

log = logging.getLogger(__name__)

RECIPE_VERSION = 1
HIDDEN_SIZE = 512
NUM_LAYERS = 4
HEAD_DIM = 64
MAX_POSITIONS = 4096


def build(target: Path, hidden: int, layers: int, seed: int = 0) -> None:
    heads = hidden // HEAD_DIM
    tiny_model.build(
        target,
        seed,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=max(1, heads // 2),
        positions=MAX_POSITIONS,
    )


def ensure_kv_model(
    hidden: int = HIDDEN_SIZE, layers: int = NUM_LAYERS, cache_dir: Path | None = None
) -> Path:
    """Path of the cached model of this size, building it first if needed."""
    base = cache_dir or tiny_model.default_cache_dir()
    target = base / f"kv-llama-h{hidden}-l{layers}-v{RECIPE_VERSION}-r{tiny_model.RECIPE_VERSION}"
    return tiny_model.cached_build(
        target, lambda staging: build(staging, hidden, layers), "the KV-routing bench model"
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(prog="python -m bench.kv_model")
    parser.add_argument("--hidden", type=int, default=HIDDEN_SIZE)
    parser.add_argument("--layers", type=int, default=NUM_LAYERS)
    args = parser.parse_args()
    print(ensure_kv_model(args.hidden, args.layers))
