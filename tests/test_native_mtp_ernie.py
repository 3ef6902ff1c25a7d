"""ERNIE-4.5-MoE's native MTP layer (``--speculate mtp``, ``add-heads --kind mtp``) on a tiny random
ernie4_5_moe checkpoint written by transformers' classes (tests/test_ernie4_5_moe.py's body) with one MTP
layer in the released names: ``model.mtp_block.0.*`` (a dense decoder layer: ``moe_layer_start_index`` 1,
as released), ``model.mtp_emb_norm.0``, ``model.mtp_hidden_norm.0``, ``model.mtp_linear_proj.0``; the final
norm is the body's ``model.norm``.

The reference drafts are transformers' own (``generate(use_mtp=True)``: ``MTPCandidateGenerator`` loads
the layer through ``MtpModel.from_pretrained``, renaming the released names itself), recorded per step as
tests/test_native_mtp.py does; mtpctl's depth-1 draft at each step equals them; ``--speculate mtp`` equals
plain greedy; the layer as read writes back bit for bit and a refresh leaves the shared ``model.norm``
alone."""

import json

import pytest
import torch

from helpers import FAMILY_PROMPTS, copy_tokenizer_files, random_reference_model, write_tiny_checkpoint

from test_ernie4_5_moe import CONFIG
from test_native_mtp import assert_depth_one_drafts_match, transformers_mtp_drafts

transformers = pytest.importorskip("transformers")

NEW = 20
MTP_NAMES = ("model.mtp_emb_norm.0.weight", "model.mtp_hidden_norm.0.weight", "model.mtp_linear_proj.0.weight")


def _mtp_tensors(tensors: dict, seed: int) -> dict:
    """One MTP layer in the released names: a dense block shaped as the body's last (dense) layer, fresh
    random weights, norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    last = "model.layers.3."
    out = {}
    for name, t in tensors.items():
        if name.startswith(last):
            fresh = torch.randn(t.shape, generator=gen) * 0.2 if t.dim() > 1 else 1 + 0.1 * torch.randn(t.shape, generator=gen)
            out["model.mtp_block.0." + name[len(last):]] = fresh
    h = CONFIG["hidden_size"]
    out.update({MTP_NAMES[0]: 1 + 0.1 * torch.randn(h, generator=gen), MTP_NAMES[1]: 1 + 0.1 * torch.randn(h, generator=gen),
                MTP_NAMES[2]: torch.randn(h, 2 * h, generator=gen) * 0.2})
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("ernie_mtp")
    folder = root / "ernie"
    random_reference_model("ernie4_5_moe", **CONFIG, num_nextn_predict_layers=1).save_pretrained(str(folder))
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    tensors = load_file(str(folder / "model.safetensors"))
    assert not any("mtp" in n for n in tensors)  # transformers writes none
    save_file({**tensors, **_mtp_tensors(tensors, seed=40)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer_files(write_tiny_checkpoint(root / "tokenizer"), folder)
    return folder


def _load(folder, speculate="none", dtype="float32", **kw):
    import mtpctl

    return mtpctl.load(str(folder), speculate=speculate, dtype=dtype, threads=1, **kw)


def test_the_layer_is_read_from_the_released_names(folder):
    from mtpctl.drafters.mtp import MtpLayers, MtpSettings
    from mtpctl.model.families.mtp_layouts import ERNIE
    from mtpctl.train.target import TargetHead

    target = TargetHead.from_folder(folder, torch.float32)
    layers = MtpLayers(target, folder)
    assert layers.layout is ERNIE and (layers.prefix, layers.block_prefix) == ("model.", "mtp_block.0.")
    assert set(layers.names) == {"enorm", "hnorm", "eh_proj"} and layers.norm is not None
    assert torch.equal(layers.norm, target.norm.detach())  # the body's final norm, not a copy of the layer's own
    assert layers.settings == MtpSettings(carry="normed", zero_first_embedding=False, own_vocab=True, hidden_first=False)
    assert layers.block.layers[0].moe is None  # layer index 0 with moe_layer_start_index 1: dense, as transformers builds it


def test_depth_one_drafts_equal_transformers_mtp_drafts(folder, monkeypatch):
    llm = _load(folder, speculate_policy="always")
    for prompt in FAMILY_PROMPTS[:2]:
        assert_depth_one_drafts_match(llm, list(prompt), *transformers_mtp_drafts(folder, list(prompt), monkeypatch,
                                                                                  new=NEW), new=NEW)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_greedy_and_batches_equal_plain_decoding(folder, dtype):
    from mtpctl.decode.session import GenerationRequest

    expected = [_load(folder, dtype=dtype).pipeline.generate(list(p), NEW).token_ids for p in FAMILY_PROMPTS]
    for depth in (1, 3):
        llm = _load(folder, "mtp", dtype, speculate_policy="always", draft_len=depth)
        assert [llm.pipeline.generate(list(p), NEW).token_ids for p in FAMILY_PROMPTS] == expected, depth
        batch = llm.generate_batch([GenerationRequest(list(p), NEW) for p in FAMILY_PROMPTS], max_batch=3)
        assert [r.token_ids for r in batch] == expected, depth


def test_the_layer_as_read_writes_back_bit_for_bit(folder, tmp_path):
    from safetensors.torch import load_file

    from mtpctl.drafters.mtp import MtpLayers
    from mtpctl.model.rewrite import rewrite_checkpoint
    from mtpctl.train.mtp import MtpHead
    from mtpctl.train.target import TargetHead

    layers = MtpLayers(TargetHead.from_folder(folder, torch.float32), folder)
    values = {layers.prefix + n: v for n, v in MtpHead(layers).tensors().items()}
    old = load_file(str(folder / "model.safetensors"))
    assert set(values) == {n for n in old if n.startswith("model.mtp_")} and "model.norm.weight" not in values
    new = load_file(str(rewrite_checkpoint(folder, tmp_path / "same", values) / "model.safetensors"))
    assert old.keys() == new.keys() and all(torch.equal(old[n], new[n]) and old[n].dtype == new[n].dtype for n in old)


def test_refresh_writes_back_only_the_mtp_tensors_and_leaves_the_shared_norm(folder, tmp_path):
    from safetensors.torch import load_file

    from mtpctl.train.mtp_refresh import refresh_mtp
    from mtpctl.train.settings import TrainSettings

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i} x{i * 7 % 5} y"}) + "\n" for i in range(6)))
    settings = TrainSettings(kind="mtp", num_heads=2, self_distill=True, response_tokens=8, lr=1e-2, steps=3,
                             holdout=0.3, batch_tokens=256, measure_prompts=0)
    refresh_mtp(folder, [data], tmp_path / "out", settings, tmp_path / "home", device="cpu")
    old, new = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    changed = {n for n in old if not torch.equal(old[n], new[n])}
    assert MTP_NAMES[2] in changed and all(n.startswith("model.mtp_") for n in changed), changed
    expected = _load(folder).pipeline.generate(list(FAMILY_PROMPTS[1]), NEW).token_ids
    llm = _load(tmp_path / "out", "mtp", speculate_policy="always", draft_len=2)
    assert llm.pipeline.generate(list(FAMILY_PROMPTS[1]), NEW).token_ids == expected
