"""The sidecar's own tokenizer: a model directory's tokenizer.json and chat template, rendered and
encoded as vLLM does (a chat without added special tokens, a prompt with them), on a worker thread
and within the decision's budget. Real vLLM's /tokenize is the reference in tests/real."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from kvgate.config import Config, ConfigError
from kvgate.local_tokenizer import LocalTokenizer
from kvgate.sidecar import build_sidecar
from kvgate.tokenize import TokenSource
from tokenizers import Tokenizer, models, pre_tokenizers, processors

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ["<s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "there", "[UNK]"]


def model_dir(tmp_path: Path) -> Path:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "bos_token": "<s>"}))
    return tmp_path


def test_a_chat_is_rendered_with_its_template_and_encoded_without_added_specials(tmp_path: Path) -> None:
    t = LocalTokenizer(model_dir(tmp_path))
    chat = {"messages": [{"role": "user", "content": "hello there"}], "add_generation_prompt": True}
    text, special = t.render(chat) or ("", True)
    assert text == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n" and not special
    assert t.encode(chat) == (1, 3, 5, 6, 2, 1, 4)
    assert t.encode({"prompt": "hello there"}) == (0, 5, 6)  # a prompt gets the BOS the tokenizer adds


def test_a_chat_encoded_piece_by_piece_is_the_whole_encoding_and_its_long_pieces_are_kept(
    tmp_path: Path,
) -> None:
    t = LocalTokenizer(model_dir(tmp_path))
    long = " ".join(["hello there"] * 200)  # a piece longer than MIN_CACHED_CHARS
    chat = {"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "there"}]}
    text, _ = t.render(chat) or ("", True)
    whole = tuple(t.tokenizer.encode(text, add_special_tokens=False).ids)
    assert t.encode(chat) == whole and len(t._pieces) == 1
    assert t.encode(chat) == whole and len(t._pieces) == 1  # the second time from the cache


def test_a_missing_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        LocalTokenizer(tmp_path / "nowhere")


def test_the_sidecar_uses_it_for_its_model_without_any_backend(tmp_path: Path) -> None:
    async def scenario() -> None:
        cfg = Config.from_mapping(
            {
                "redis": {"url": None},
                "kv_index": {"tokenizer_files": {"m": str(model_dir(tmp_path))}},
                "backends": [{"url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:2"}],
            }
        )
        sc = build_sidecar(cfg, None)  # the backend is never asked (it is not even healthy)
        async with aiohttp.ClientSession() as session:
            source = TokenSource(cfg.kv_index, sc.registry, sc.metrics, session)
            body = json.dumps({"model": "m", "prompt": "hello there"})
            assert await source.tokens("m", body) == (0, 5, 6)
            assert await source.tokens("other", body) is None  # no local tokenizer, no backend
        assert sc.metrics.registry.get_sample_value("kvgate_tokenize_total", {"result": "ok"}) == 1

    asyncio.run(scenario())
