"""The fleet itself: the model is built from code to the same bytes every time, and its tokenizer
reads the benchmark's vocabulary one word to one token."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.real.conftest import Tokens
from vllm_real.fleet import MODEL_DIR, VENV

pytestmark = pytest.mark.real
ROOT = Path(__file__).resolve().parents[2]


def test_the_model_builds_to_the_same_bytes(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(VENV / "bin" / "python"), str(ROOT / "vllm_real" / "model.py"), "--out", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "m" / "MANIFEST").read_text() == (MODEL_DIR / "MANIFEST").read_text()


def test_the_vocabulary_is_one_token_a_word(tokens: Tokens) -> None:
    assert abs(tokens.per_word - 1.0) < 0.02, tokens.per_word
