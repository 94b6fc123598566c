"""Shared test setup.

Tests never touch the network: the HF offline switches are set here, before any test
imports `datasets` / `huggingface_hub` (both read them once, at import time).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest  # noqa: E402

from titan.paths import REPO_ROOT  # noqa: E402

TOKENIZER_PATH = REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json"


@pytest.fixture(scope="session")
def tokenizer():
    from titan.components.data.tokenizer import Tokenizer

    return Tokenizer(str(TOKENIZER_PATH))
