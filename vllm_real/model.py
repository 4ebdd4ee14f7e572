"""Builds the tiny model the real-vLLM fleet serves, from code alone: no download, same bytes each time.

No weights can be fetched here, and none are needed: kvgate routes on what a server does with a
prompt (prefill, prefix cache, queueing, streaming), not on what the model says. So the model is a
Llama with random weights from a fixed seed (2 layers, hidden 128, 4 heads, 2 KV heads, float32,
32k positions) and its tokenizer a byte-level BPE of 4,096 tokens trained on text generated from a
fixed seed (mostly the benchmark's vocabulary, vllm_real/vocabulary.py, so that each of its words is
one token), with a ChatML chat template. Output is gibberish; send ``"ignore_eos": true`` to get
exactly ``max_tokens`` tokens.

Runs with the fleet's own interpreter (``.vllm-venv/bin/python vllm_real/model.py --out DIR``): it
needs torch, transformers and tokenizers, which vLLM brings, and nothing of kvgate. ``make
real-vllm`` calls it; ``MANIFEST`` (sha256 of every file) lets a rebuild prove it made the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script by the fleet's Python
from vllm_real.vocabulary import WORDS

SEED = 20261203
VOCAB = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


ENGLISH = (
    "the of and to in is that it for on was with as by at be this from or an are not have had were but "
    "can all will one would there their what so up out if about who get which go me when make like time "
    "no just him know take people into year your good some could them see other than then now look only "
    "come its over think also back after use two how our work first well way even new want because any "
    "these give day most us model token cache prefix block route node load question answer"
).split()


def sentences(n: int, seed: int) -> list[str]:
    """Text to train the tokenizer on: mostly the benchmark's vocabulary (vllm_real.vocabulary), so
    that each of its words is one token, some English, digits and punctuation. Deterministic."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pool = WORDS if rng.random() < 0.8 else ENGLISH
        line = " ".join(rng.choice(pool) for _ in range(rng.randint(5, 30)))
        out.append(line.capitalize() + rng.choice([".", "?", "!", ","]) + f" {rng.randint(0, 9999)}")
    return out


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences(60_000, SEED), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=1, sort_keys=True) + "\n"
    )


def build_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    # The generation config transformers writes names its own version; vLLM needs none of it.
    (out / "generation_config.json").unlink(missing_ok=True)


def manifest(out: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.is_file() and p.name != "MANIFEST"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: the same merges every time
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp)
    build_model(tmp)
    (tmp / "MANIFEST").write_text(json.dumps(manifest(tmp), indent=1, sort_keys=True) + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)  # whole or not at all: an interrupted build leaves no half model behind
    print(f"built {args.out}")


if __name__ == "__main__":
    main()
