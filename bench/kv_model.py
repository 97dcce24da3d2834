"""A bigger random-weight Llama for the KV-routing benchmark (bench/p10_kv_routing.py): the tiny
model's tokenizer and recipe (worker/dev/tiny_model.py), but wide and deep enough that prefill
is a visible share of TTFT on a CPU, and 4096 positions for long conversations. Seeded and
cached beside the tiny model, under its own name.

    python -m bench.kv_model [--hidden 512 --layers 4]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path

from worker.dev import tiny_model

log = logging.getLogger(__name__)

RECIPE_VERSION = 1
HIDDEN_SIZE = 512
NUM_LAYERS = 4
HEAD_DIM = 64
MAX_POSITIONS = 4096


def build(target: Path, hidden: int, layers: int, seed: int = 0) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tok = tiny_model._train_tokenizer()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf_tok.chat_template = tiny_model.CHAT_TEMPLATE
    heads = hidden // HEAD_DIM
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(tiny_model.LM_HEAD_SCALE)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(target, safe_serialization=True)
    hf_tok.save_pretrained(target)


def ensure_kv_model(
    hidden: int = HIDDEN_SIZE, layers: int = NUM_LAYERS, cache_dir: Path | None = None
) -> Path:
    """Path of the cached model of this size, building it first if needed."""
    base = cache_dir or tiny_model.default_cache_dir()
    target = base / f"kv-llama-h{hidden}-l{layers}-v{RECIPE_VERSION}-r{tiny_model.RECIPE_VERSION}"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the KV-routing bench model in %s", target)
    staging = Path(tempfile.mkdtemp(prefix=".kv-", dir=target.parent))
    try:
        build(staging, hidden, layers)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(prog="python -m bench.kv_model")
    parser.add_argument("--hidden", type=int, default=HIDDEN_SIZE)
    parser.add_argument("--layers", type=int, default=NUM_LAYERS)
    args = parser.parse_args()
    print(ensure_kv_model(args.hidden, args.layers))
