"""Drafters that hold tensors of their own, on a virtual GPU (tests/virtual_cuda.py): a checkpoint's native
MTP layer (its projection, norms and block loaded from the file) and a draft model whose vocabulary maps to
the target's through an id map (its blocked ids and the map's indices). None may mix a host tensor into a
device op (a crash on a real GPU); greedy speculation gives plain greedy's tokens, and sampled speculation
with a draft model runs through rejection sampling (the draft's distributions on the device, the target's
row on the host)."""

import collections

import pytest

from mtpctl.backends.torch import TorchSession
from mtpctl.decode.sampling import SamplingParams
from mtpctl.drafters.build import DraftOptions, build
from virtual_cuda import virtual_cuda

from test_glm_deepseek_families import PROMPTS
from test_native_mtp import folders  # noqa: F401  (tiny glm4_moe / deepseek_v3 checkpoints with an MTP layer)
from test_pair import variants  # noqa: F401  (tiny drafts whose vocabularies map to the target's)

NEW = 16


def mixups(mode) -> dict:
    return dict(collections.Counter((e.what, e.site) for e in mode.events if e.kind == "mixup"))


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3"])
def test_native_mtp_layers_draft_on_the_device(folders, model_type):  # noqa: F811
    from mtpctl.drafters.mtp import mtp_drafter

    with virtual_cuda() as mode:
        session = TorchSession(folders[model_type], "float32", device="cuda", kernels="torch")
        prompt = list(PROMPTS[0])
        plain = session.generate(prompt, NEW).token_ids
        drafter = mtp_drafter(session, 3)
        assert drafter.layers[0].eh_proj.device.type == "cuda"
        result = session.generate(prompt, NEW, drafter=drafter)
    assert result.token_ids == plain
    assert result.stats.draft_tokens > 0
    assert not mixups(mode), mixups(mode)


@pytest.mark.parametrize("name", ["padded", "added"])
def test_a_mapped_draft_model_drafts_greedy_and_sampled_on_the_device(variants, name):  # noqa: F811
    sampling = SamplingParams(temperature=0.8, seed=3)
    with virtual_cuda() as mode:
        session = TorchSession(variants["target"], "float32", device="cuda", kernels="torch")
        prompt = session.encode("count: 1 2 3 1 2 3")
        plain = session.generate(prompt, NEW).token_ids
        greedy = build(session, "draft", DraftOptions(draft_model=str(variants[name]), draft_len=3))
        assert session.generate(prompt, NEW, drafter=greedy).token_ids == plain
        sampled = build(session, "draft", DraftOptions(draft_model=str(variants[name]), draft_len=3), sampling)
        result = session.generate(prompt, NEW, sampling, sampled)
    assert len(result.token_ids) == NEW and result.stats.draft_tokens > 0
    assert not mixups(mode), mixups(mode)


@pytest.mark.parametrize("dynamic", [False, True])
def test_eagle_heads_draft_on_the_device(tiny_folder, tmp_path, dynamic):
    """EAGLE heads loaded onto the device (static and dynamic trees) draft there: their own KV (which
    starts empty and grows), positions and masks go where the layer is, and greedy speculation gives plain
    greedy's tokens. Before the virtual device knew empty tensors, the heads' empty KV looked like host
    memory and this would have been reported as a mix-up."""
    from helpers import random_eagle
    from mtpctl.drafters.heads.folder import save_heads

    cpu = TorchSession(tiny_folder, "float32", device="cpu", kernels="torch")
    head = random_eagle(cpu.model, depth=4, seed=2)
    head.cfg.target, head.cfg.target_hash = str(tiny_folder), cpu.target_hash()
    (tmp_path / "eagle").mkdir()
    save_heads(head, tmp_path / "eagle")
    with virtual_cuda() as mode:
        session = TorchSession(tiny_folder, "bfloat16", device="cuda", kernels="torch")
        prompt = session.encode("count: 1 2 3 1 2 3")
        plain = session.generate(prompt, NEW).token_ids
        drafter = build(session, "heads", DraftOptions(heads_dir=str(tmp_path / "eagle"), tree_nodes=20,
                                                       dynamic_tree=dynamic))
        assert drafter.keys.device.type == "cuda"
        result = session.generate(prompt, NEW, drafter=drafter)
    assert result.token_ids == plain
    assert result.stats.draft_tokens > 0
    assert not mixups(mode), mixups(mode)
