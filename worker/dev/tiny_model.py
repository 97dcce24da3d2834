"""A tiny random-weight Llama-style model with a locally trained tokenizer, built once and cached.

There is no model hub here: the demo and the tests need a real checkpoint directory that vLLM and
transformers both load like any other. Everything is seeded, so every build is identical.
The tokenizer is Llama-like: Metaspace pre-tokenizer, BPE with byte fallback, and the 256
`<0xNN>` byte tokens as ordinary vocabulary entries (ids 3..258), so generated text contains
single-byte tokens whose true bytes are not valid UTF-8 on their own.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.config import dev_cache_dir

log = logging.getLogger(__name__)

# Bump when the recipe changes: the cache key must change with the saved files.
# 2: the tokenizer has a chat template (the OpenAI frontend's /v1/chat/completions needs one).
# 3, 4: the chat template renders tools and tool messages (hermes-style), tersely.
RECIPE_VERSION = 4
HIDDEN_SIZE = 128
NUM_HEADS = 4  # head_dim 32: the smallest head size vLLM's CPU attention supports
NUM_KV_HEADS = 2
NUM_LAYERS = 2
MAX_POSITIONS = 1024
TARGET_VOCAB = 1024
# Random init gives nearly uniform next-token distributions; scaling the output head makes them
# peaked, so greedy choices are not decided by float noise between engines.
LM_HEAD_SCALE = 30.0
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# A plain role-tagged layout: one line per message, then the assistant's tag. vLLM's OpenAI
# server and this project's frontend both render it, so their prompts are the same token ids.
# Tools render hermes-style (vLLM's `hermes` tool parser reads the answer back): a line listing
# them in <tools>, an assistant's calls as <tool_call>{"name", "arguments"}</tool_call>, a
# tool's answer in <tool_response>. Without tools the layout is the plain one. (Tersely: the
# tokenizer spends about 150 tokens on a tool's JSON, and the tests' engines hold 512.)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}[tools] <tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "[tool] <tool_response>{{ message['content'] }}</tool_response>\n"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "[assistant] {{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] %}"
    "<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}{{ '\\n' }}"  # a newline after a block tag is trimmed (HF's trim_blocks)
    "{% else %}[{{ message['role'] }}] {{ message['content'] }}\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def default_cache_dir() -> Path:
    return dev_cache_dir()


def _corpus(seed: int = 0, sentences: int = 3000) -> list[str]:
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "st", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "é"]
    codas = ["", "n", "r", "s", "t", "l", "nd", "ng"]
    words = [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(k))
        for k in (rng.randint(1, 3) for _ in range(400))
    ]
    lines = []
    for _ in range(sentences):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        lines.append(sentence.capitalize() + rng.choice([".", "!", "?", ","]))
    return lines


def _train_tokenizer() -> Any:  # tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB - 256, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)

    # Re-lay the vocabulary as Llama does: specials, then the 256 byte tokens as ordinary
    # entries (byte fallback looks them up in the model's vocab), then the learned pieces.
    spec = json.loads(tok.to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab: dict[str, int] = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in learned:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    spec["model"]["vocab"] = vocab
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    return tok


def build(
    target: Path,
    seed: int = 0,
    *,
    hidden: int = HIDDEN_SIZE,
    layers: int = NUM_LAYERS,
    heads: int = NUM_HEADS,
    kv_heads: int = NUM_KV_HEADS,
    positions: int = MAX_POSITIONS,
) -> None:
    """The tiny model in `target`; other shapes (a benchmark's bigger model) keep the recipe."""
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tok = _train_tokenizer()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(target, safe_serialization=True)
    hf_tok.save_pretrained(target)


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Path of the cached tiny model, building it first if needed (a few seconds)."""
    target = (cache_dir or default_cache_dir()) / f"tiny-llama-v{RECIPE_VERSION}"
    return cached_build(target, build, "the tiny demo model")


def cached_build(target: Path, make: Callable[[Path], None], what: str) -> Path:
    """`target`, made by `make(directory)` unless a model is there already."""
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building %s in %s", what, target)
    # Build beside the target and rename: concurrent builders never see a half-written model.
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        make(staging)
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
    print(ensure_tiny_model())
