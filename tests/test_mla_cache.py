"""DeepSeek-V3's compressed (latent) KV cache on a tiny random checkpoint written by transformers' own
classes (tests/test_glm_deepseek_families.py's config: 3 layers, kv_lora_rank 32, qk_rope_head_dim 16):
the cache holds per token and layer only the normed latent and the rotated rotary key (the values
transformers' own cache holds), ``(kv_lora_rank + qk_rope_head_dim) x layers x 4`` bytes a slot; a
rollback in the middle of a committed draft and a draft tree's non-prefix path give plain decoding's
logits bit for bit; the absorbed products give a row the same alone and among others; a self-draft
(whose draft engine rolls back every step) equals plain greedy decoding."""

import pytest
import torch

from helpers import FAMILY_PROMPTS, copy_tokenizer_files, random_reference_model, write_tiny_checkpoint
from test_glm_deepseek_families import COMMON, EXTRA

import mtpctl
from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.attention import TAIL
from mtpctl.decode.tree import DraftTree
from mtpctl.model.decoder import Decoder, head_products
from mtpctl.model.kv_cache import LatentCache

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' model, its checkpoint folder with the tiny tokenizer)."""
    root = tmp_path_factory.mktemp("mla")
    tokenizer = write_tiny_checkpoint(root / "tokenizer")
    reference = random_reference_model("deepseek_v3", **COMMON, **EXTRA["deepseek_v3"])
    folder = root / "deepseek_v3"
    reference.save_pretrained(str(folder))
    copy_tokenizer_files(tokenizer, folder)
    return reference, folder


def test_the_cache_holds_each_tokens_latent_and_rotary_key_only(checkpoint):
    reference, folder = checkpoint
    model = Decoder.from_folder(folder)
    prompt = list(FAMILY_PROMPTS[0])
    engine = TorchEngine(model, len(prompt) + 8)
    engine.prefill(prompt)
    assert isinstance(engine.cache, LatentCache) and not engine.native
    with torch.no_grad():
        past = reference(torch.tensor([prompt]), use_cache=True).past_key_values
    for i in range(COMMON["num_hidden_layers"]):  # transformers caches the normed latent and the turned k_rot
        theirs = torch.cat((past.layers[i].keys[0, 0], past.layers[i].values[0, 0]), dim=-1)
        assert (engine.cache.k[i, 0, 0, :len(prompt)] - theirs).abs().max() < 1e-5
    m = model.cfg.mla
    per_slot = (m.kv_lora_rank + m.qk_rope_head_dim) * COMMON["num_hidden_layers"] * 4  # float32
    assert engine.kv_cache_bytes == per_slot * (engine.capacity + TAIL)
    llm = mtpctl.load(str(folder), speculate="none", dtype="bfloat16", threads=1)
    stats = llm.pipeline.generate(prompt, 4).stats
    assert llm.session.attention == "torch" and stats.kv_cache_bytes % per_slot == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rollback_mid_draft_and_a_tree_path_give_plain_decodings_rows(checkpoint, dtype):
    model = mtpctl.load(str(checkpoint[1]), speculate="none", dtype=dtype, threads=1).session.model
    prompt, steps = list(FAMILY_PROMPTS[1]), 8
    plain = TorchEngine(model, len(prompt) + steps + 8)
    tokens = [int(plain.prefill(prompt).logits[-1].argmax())]
    rows = []  # rows[j]: plain decoding's logits after tokens[j]
    for _ in range(steps):
        rows.append(plain.verify(DraftTree.chain(tokens[-1:])).logits[0])
        plain.commit([0])
        tokens.append(int(rows[-1].argmax()))
    spec = TorchEngine(model, plain.capacity)
    spec.prefill(prompt)
    wrong = (tokens[3] + 1) % model.cfg.vocab_size
    got = spec.verify(DraftTree.chain(tokens[:3] + [wrong])).logits
    assert all(torch.equal(got[j], rows[j]) for j in range(3))
    spec.commit([0, 1, 2, 3])
    spec.rollback(spec.length - 2)  # forget tokens[2] and the wrong draft
    tree = DraftTree.from_parents([tokens[2], wrong, tokens[3], tokens[4]], [-1, 0, 0, 2])
    got = spec.verify(tree).logits
    assert torch.equal(got[0], rows[2]) and torch.equal(got[2], rows[3]) and torch.equal(got[3], rows[4])
    spec.commit([0, 2, 3])  # a path that is not a prefix: its slots are copied into place
    got = spec.verify(DraftTree.chain(tokens[5:8])).logits
    assert all(torch.equal(got[j], rows[5 + j]) for j in range(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_products_give_a_row_the_same_alone_and_among_others(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 13, 16, generator=gen) * torch.logspace(-2, 2, 13)[:, None]).to(dtype)
    w = torch.randn(4, 16, 32, generator=gen).to(dtype)
    whole = head_products(x, w, 4)
    assert (whole.float() - torch.matmul(x.float(), w.float())).abs().max() < 0.1 * whole.float().abs().max()
    for start, n in ((0, 1), (5, 1), (12, 1), (2, 5), (7, 6)):
        assert torch.equal(head_products(x[:, start:start + n], w, 4), whole[:, start:start + n])


def test_a_self_draft_equals_plain_decoding(checkpoint):
    folder, prompt = str(checkpoint[1]), list(FAMILY_PROMPTS[2])
    plain = mtpctl.load(folder, speculate="none", dtype="float32", threads=1)
    draft = mtpctl.load(folder, speculate="draft", draft_model="self:0-1", speculate_policy="always",
                        dtype="float32", threads=1)
    result = draft.pipeline.generate(prompt, 24)
    assert result.token_ids == plain.pipeline.generate(prompt, 24).token_ids and result.stats.draft_tokens > 0


def test_a_grown_cache_holds_the_committed_rows():
    small, big = LatentCache(2, 1, 8, 4, 5, spare=2), LatentCache(2, 1, 8, 4, 12, spare=2)
    rows = torch.randn(1, 1, 5, 12)
    for layer in range(2):
        small.write(layer, rows + layer)
    small.advance(4)
    big.copy_committed(small)  # what the MTP drafter does when a request outgrows its cache
    assert big.length == 4 and torch.equal(big.k[:, :, :, :4], small.k[:, :, :, :4]) and not big.k[:, :, :, 4:].any()
    assert torch.equal(big.v[1, 0, 0, :4], rows[0, 0, :4, :8] + 1)
    with pytest.raises(ValueError):
        LatentCache(2, 1, 8, 4, 3).copy_committed(small)


def test_latent_attention_on_a_virtual_gpu_mixes_no_host_tensor_and_syncs_nowhere(checkpoint):
    from virtual_cuda import virtual_cuda

    from mtpctl.backends.torch import TorchSession

    with virtual_cuda() as mode:
        session = TorchSession(checkpoint[1], "float32", device="cuda", kernels="torch")
        prompt = list(FAMILY_PROMPTS[0])
        mode.events.clear()
        assert len(session.generate(prompt, 6).token_ids) == 6
    bad = [e for e in mode.events if e.kind == "mixup" or (e.kind == "sync" and "decoder.py" in e.site)]
    assert not bad, bad
    assert session.model.layers[0].moe_rows == 64  # the CUDA placement's fixed row blocks
