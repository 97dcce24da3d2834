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


def build_embedding_model(target: Path) -> None:
    """A second tiny model, for embeddings: another seed and width than the generator, its
    config marked Matryoshka (`is_matryoshka`, which vLLM reads) so a request may shorten its
    vectors (`dimensions`). Served as a pooling run: `--runner pooling --convert embed`."""
    build(target, seed=5, hidden=64, heads=2, kv_heads=1)
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config["is_matryoshka"] = True
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def ensure_tiny_embedding_model(cache_dir: Path | None = None) -> Path:
    """Path of the cached tiny embedding model (worker.dev.tiny_model.build_embedding_model)."""
    target = (cache_dir or default_cache_dir()) / f"tiny-embed-v{RECIPE_VERSION}"
    return cached_build(target, build_embedding_model, "the tiny embedding model")


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Path of the cached tiny model, building it first if needed (a few seconds)."""
    target = (cache_dir or default_cache_dir()) / f"tiny-llama-v{RECIPE_VERSION}"
    return cached_build(target, build, "the tiny demo model")


# The LoRA adapter's shape: every projection of every layer, rank 8 (vLLM's --max-lora-rank
# default is 16). Its B is random, not zero as in a fresh PEFT adapter, so that it changes the
# model's answers; LORA_SCALE makes the change large enough to move greedy tokens.
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_SCALE = 0.5


def build_lora(target: Path, base: Path, seed: int = 1) -> None:
    """A LoRA adapter of the tiny model in PEFT's file format (adapter_config.json and
    adapter_model.safetensors, the names PEFT's save_pretrained writes), random A and B."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = {  # (in, out) of each projection
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inner),
        "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name in LORA_TARGETS:
            fan_in, fan_out = shapes[name]
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            a = torch.randn(LORA_RANK, fan_in, generator=generator) / fan_in**0.5
            b = torch.randn(fan_out, LORA_RANK, generator=generator) * LORA_SCALE
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (target / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


def ensure_tiny_lora(cache_dir: Path | None = None, seed: int = 1) -> Path:
    """Path of a cached LoRA adapter of the tiny model (`seed` picks its weights)."""
    base = ensure_tiny_model(cache_dir)
    target = base.parent / f"tiny-llama-v{RECIPE_VERSION}-lora-{seed}"
    return cached_build(
        target,
        lambda directory: build_lora(directory, base, seed),
        "a LoRA adapter of the tiny model",
        marker="adapter_config.json",
    )


def cached_build(
    target: Path, make: Callable[[Path], None], what: str, *, marker: str = "config.json"
) -> Path:
    """`target`, made by `make(directory)` unless it is there already (its `marker` file; a
    model's tokenizer.json too)."""
    done = (target / marker).exists()
    if done and (marker != "config.json" or (target / "tokenizer.json").exists()):
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
