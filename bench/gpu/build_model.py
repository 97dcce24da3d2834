"""A ~1B-parameter random-weight Llama (bf16) with a 32k tokenizer trained here: the GPU runs'
model. No model hub on the device machine; everything is seeded.

`--size 8b` builds Llama-3-8B's shape instead (hidden 4096, intermediate 14336, 32 layers, 32
heads, 8 KV heads; with this 32k vocabulary 7.24 B parameters, ~14.5 GB of safetensors): the
model of the multi-GPU runs, big enough that tensor parallelism matters. It is initialised in
bf16 directly on the device (random init of 7.2 B parameters in fp32 and a cast would need
~45 GB and take longer); the 1b model is initialised in fp32 and then cast, so that its weights
stay the ones every recorded 1b figure (bench/RESULTS.md) was measured with.

The tokenizer is Llama-like (Metaspace, BPE with byte fallback, the 256 `<0xNN>` byte tokens in
the vocabulary), trained on random syllable words until it has VOCAB pieces, so token text and
bytes are as varied as a real vocabulary's.

    python -m bench.gpu.build_model /tmp/llama-1b [--device cuda]
    python -m bench.gpu.build_model /tmp/llama-8b --size 8b
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

VOCAB = 32000
SHAPE = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=20,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096,
)
SHAPES = {
    "1b": SHAPE,
    # Llama-3-8B's transformer (its rope_theta too); the vocabulary stays this tokenizer's 32k.
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}
SPECIAL = ["<unk>", "<s>", "</s>"]


def _corpus(seed: int = 0, words: int = 60000, lines: int = 60000) -> list[str]:
    rng = random.Random(seed)
    syllables = [o + v + c for o in "bcdfghjklmnprstvwz" for v in "aeiouyé" for c in ["", "n", "r"]]
    vocab = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(words)]
    return [" ".join(rng.choices(vocab, k=12)) + rng.choice(".!?,") for _ in range(lines)]


def train_tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 256, special_tokens=SPECIAL, show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    spec = json.loads(tok.to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {name: i for i, name in enumerate(SPECIAL)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in learned:
        vocab.setdefault(piece, len(vocab))
    spec["model"]["vocab"] = vocab
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


def build(target: Path, device: str, size: str = "1b") -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    started = time.time()
    tok = train_tokenizer()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", **SHAPES[size]
    )
    torch.manual_seed(0)
    if size == "1b":
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
    else:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default_dtype)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(target, safe_serialization=True)
    hf_tok.save_pretrained(target)
    print(
        f"{target}: {params / 1e9:.2f} B parameters, tokenizer {tok.get_vocab_size()} pieces, "
        f"{time.time() - started:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--size", choices=sorted(SHAPES), default="1b", help="model shape (default: 1b)"
    )
    args = parser.parse_args()
    build(args.target, args.device, args.size)


if __name__ == "__main__":
    main()
