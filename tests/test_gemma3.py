"""Gemma 3 (``gemma3_text``) in the native runtime.

Tiny random checkpoints: parity with HF transformers' Gemma3ForCausalLM for prefill, chain and draft
tree verification, with a sliding window (4) shorter than the sequences so the window matters, and the
config's two formats (HF v5 ``rope_parameters`` by layer type, older ``rope_local_base_freq`` keys).
Real Gemma 3 270M (``@pytest.mark.real``, skipped when its packages are not installed): logits parity
with transformers on the same imported folder, 32-token greedy against ``generate``, BOS handling of
the tokenizer path, and ``mtpctl generate --speculate ngram`` equal to plain greedy.
"""

import dataclasses
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from helpers import GEMMA3_TINY as TINY, GEMMA3_VOCAB as VOCAB, first_divergence, top2_gap
from mtpctl.errors import UnsupportedModel
from mtpctl.model.config import DecoderConfig, RopeConfig
from mtpctl.backends.torch import TorchEngine
from mtpctl.model.decoder import Decoder
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.tree import DraftTree

TOL = 1e-4
NEAR_TIE = 1e-3
GREEDY = SamplingParams()


def hf_gemma3(folder, **extra):
    """A random tiny Gemma3ForCausalLM saved to ``folder`` (weights and norms larger than the default
    init so that every part of the block, the norms' ``1 + w`` included, moves the logits)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    reference = Gemma3ForCausalLM(Gemma3TextConfig(**{**TINY, **extra})).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.3)
    reference.save_pretrained(str(folder))
    return reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers reference, our Decoder, checkpoint folder) of one tiny random checkpoint."""
    folder = tmp_path_factory.mktemp("gemma3-tiny")
    reference = hf_gemma3(folder)
    return reference, Decoder.from_folder(folder), folder


def reference_last_logits(reference, ids):
    """transformers' logits ``[vocab]`` for the token after ``ids`` (the token-by-token definition)."""
    with torch.no_grad():
        return reference(torch.tensor([list(ids)])).logits[0, -1]


def ids_of(n, seed=1):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("extra", [{}, {"final_logit_softcapping": 5.0}])
def test_prefill_and_verify_logits_match_transformers(tmp_path, extra):
    reference = hf_gemma3(tmp_path, **extra)
    model = Decoder.from_folder(tmp_path)
    assert model.cfg.final_logit_softcapping == extra.get("final_logit_softcapping")
    ids = ids_of(12)  # three times the sliding window
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    verified = TorchEngine(model, 16).verify(DraftTree.chain(ids)).logits  # batch-invariant path, every row
    prefilled = TorchEngine(model, 16).prefill(ids).logits  # fast SDPA path, last row
    assert (verified - expected).abs().max().item() < TOL
    assert (prefilled[-1] - expected[-1]).abs().max().item() < TOL
    if extra:
        assert expected.abs().max().item() <= 5.0


def test_sliding_window_changes_the_logits(tiny):
    """Without the window (every layer global) our logits move far from transformers': the windowed
    parity is not an accident of short sequences."""
    reference, model, folder = tiny
    full = Decoder(dataclasses.replace(model.cfg, layer_windows=(None,) * 4))
    full.load_hf_tensors({k: v for k, v in load_file(str(folder / "model.safetensors")).items()
                          if k != "lm_head.weight"})
    ids = ids_of(12)
    expected = reference_last_logits(reference, ids)
    assert (TorchEngine(model, 12).verify(DraftTree.chain(ids)).logits[-1] - expected).abs().max() < TOL
    assert (TorchEngine(full, 12).verify(DraftTree.chain(ids)).logits[-1] - expected).abs().max() > 1e-2


def test_chain_verify_matches_token_by_token_decoding(tiny):
    reference, model, _ = tiny
    prompt, chain = ids_of(7), ids_of(6, seed=2)
    engine = TorchEngine(model, 16)
    engine.prefill(prompt)
    verified = engine.verify(DraftTree.chain(chain)).logits
    sequential = TorchEngine(model, 16)
    sequential.prefill(prompt)
    for i, token in enumerate(chain):
        row = sequential.verify(DraftTree.chain([token])).logits[-1]
        sequential.commit([0])
        expected = reference_last_logits(reference, prompt + chain[:i + 1])
        assert (verified[i] - expected).abs().max().item() < TOL, i
        assert (verified[i] - row).abs().max().item() < TOL, i


def test_draft_tree_verify_and_commit_match_transformers(tiny):
    """Each node of a draft tree scores as its root-to-node path decoded token by token; after the
    accepted path is committed (copied into place), decoding continues as on the plain sequence."""
    reference, model, _ = tiny
    prompt = ids_of(6)
    parents = [-1, 0, 0, 1, 1, 2, 5, 6]  # depth up to 4: paths cross the window of 4
    tokens = ids_of(len(parents), seed=3)

    def path(node):
        out = []
        while node >= 0:
            out.append(node)
            node = parents[node]
        return out[::-1]

    engine = TorchEngine(model, 24)
    engine.prefill(prompt)
    out = engine.verify(DraftTree.from_parents(tokens, parents))
    for node in range(len(parents)):
        expected = reference_last_logits(reference, prompt + [tokens[j] for j in path(node)])
        assert (out[node] - expected).abs().max().item() < TOL, node
    accepted = path(7)  # [0, 2, 5, 6, 7]: not a prefix of the node order, so KV entries move
    engine.commit(accepted)
    nxt = ids_of(2, seed=4)
    rows = engine.verify(DraftTree.chain(nxt)).logits
    sequence = prompt + [tokens[j] for j in accepted]
    assert (rows[0] - reference_last_logits(reference, sequence + nxt[:1])).abs().max().item() < TOL
    assert (rows[1] - reference_last_logits(reference, sequence + nxt)).abs().max().item() < TOL


def test_bfloat16_verify_is_bit_identical_to_decoding(tmp_path):
    """bfloat16 matmuls are batch-invariant here, so a verify pass equals plain decoding exactly
    (what makes greedy speculation lossless) with Gemma's extra norms and local rope too."""
    hf_gemma3(tmp_path)
    model = Decoder.from_folder(tmp_path, torch.bfloat16)
    prompt, chain = ids_of(5), ids_of(6, seed=2)
    engine = TorchEngine(model, 16)
    engine.prefill(prompt)
    verified = engine.verify(DraftTree.chain(chain)).logits
    engine.prefill(prompt)
    for i, token in enumerate(chain):
        assert torch.equal(engine.verify(DraftTree.chain([token])).logits[-1], verified[i]), i
        engine.commit([0])


def test_config_formats_and_defaults():
    v5 = DecoderConfig.from_dict({"model_type": "gemma3_text", **TINY})
    assert v5.layer_windows == (4, None, 4, 4)
    assert v5.rope == RopeConfig(theta=10000.0) and v5.rope_local == RopeConfig(theta=100.0)
    assert v5.scale == 24 ** -0.5 and v5.hidden_act == "gelu_pytorch_tanh" and v5.tie_word_embeddings
    assert v5.qk_norm and v5.sandwich_norms and v5.scaled_embeddings and v5.norm_offset == 1.0
    older = {k: v for k, v in TINY.items() if k not in ("rope_parameters", "layer_types")}
    older.update(model_type="gemma3_text", rope_theta=10000.0, rope_local_base_freq=100.0,
                 sliding_window_pattern=2, hidden_activation="gelu_pytorch_tanh")
    legacy = DecoderConfig.from_dict(older)
    assert legacy.layer_windows == (4, None, 4, None)  # every 2nd layer global
    assert (legacy.rope, legacy.rope_local) == (v5.rope, v5.rope_local)
    minimal = DecoderConfig.from_dict({"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 8,
                                       "intermediate_size": 8, "num_hidden_layers": 6, "num_attention_heads": 2})
    assert minimal.layer_windows == (4096,) * 5 + (None,)  # Gemma3TextConfig's defaults
    assert (minimal.rope.theta, minimal.rope_local.theta, minimal.head_dim) == (1e6, 1e4, 256)
    assert minimal.scale == 256 ** -0.5
    llama = DecoderConfig.from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
                                     "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2})
    assert llama.rope_local is None and not llama.sandwich_norms and llama.scale == 4 ** -0.5


@pytest.mark.parametrize("key, value", [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True),
                                        ("hidden_activation", "gelu")])
def test_unsupported_gemma3_options(key, value):
    with pytest.raises(UnsupportedModel, match=key):
        DecoderConfig.from_dict({"model_type": "gemma3_text", **TINY, key: value})


# --- the real Gemma 3 270M -----------------------------------------------------------------------

PROMPT = "The three primary colors are red, blue and"


@pytest.fixture(scope="module")
def one_thread():
    """Real-model tests run on one torch thread: on a small shared test machine a second intra-op
    thread that gets descheduled stalls every small op of a decode step (about 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gemma3(gemma3_folder, one_thread):
    from mtpctl.backends.torch import TorchSession

    return TorchSession(gemma3_folder)


@pytest.fixture(scope="module")
def gemma3_reference(gemma3_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma3_folder), dtype=torch.float32).eval()


@pytest.mark.real
def test_real_logits_match_transformers(gemma3, gemma3_reference):
    ids = gemma3.encode(PROMPT, chat=False)
    with torch.no_grad():
        expected = gemma3_reference(torch.tensor([ids])).logits[0]
    ours = TorchEngine(gemma3.model, len(ids)).verify(DraftTree.chain(ids)).logits
    diff = (ours - expected).abs().max().item()
    print(f"gemma3-270m float32 max abs logit diff vs transformers: {diff:.3e} over {len(ids)} tokens")
    assert diff <= TOL


@pytest.mark.real
def test_real_32_token_greedy_matches_transformers_generate(gemma3, gemma3_reference):
    ids = gemma3.encode(PROMPT, chat=False)
    with torch.no_grad():
        expected = gemma3_reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                             eos_token_id=sorted(gemma3.codec.eos_ids))[0, len(ids):].tolist()
    ours = gemma3.generate(ids, 32, GREEDY).token_ids
    i = first_divergence(expected, ours)
    if i < 0:
        assert ours == expected
        assert len(ours) == 32 or ours[-1] in gemma3.codec.eos_ids
        return
    engine = TorchEngine(gemma3.model, len(ids) + i + 1)
    gap = top2_gap(engine.prefill(ids + ours[:i]).logits[-1])
    assert gap < NEAR_TIE, f"divergence at token {i} with top-2 logit gap {gap:.2e}: a bug, not a near-tie"
    warnings.warn(f"near-tie flip at token {i} (top-2 gap {gap:.2e})")


@pytest.mark.real
def test_real_tokenizer_adds_one_bos(gemma3, monkeypatch):
    tokenizer = gemma3.codec.tokenizer
    bos = tokenizer.bos_token_id
    raw = gemma3.encode(PROMPT, chat=True)  # the imported base model has no chat template: raw text
    assert not gemma3.codec.has_chat_template
    assert bos == 2 and raw == [bos] + tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    # Gemma's chat templates start with {{ bos_token }}: the template's BOS is the only one
    monkeypatch.setattr(tokenizer, "chat_template", (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
        "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"))
    tokens = tokenizer.convert_ids_to_tokens(gemma3.encode("Hi"))
    assert tokens == ["<bos>", "<start_of_turn>", "user", "\n", "Hi", "<end_of_turn>", "\n",
                      "<start_of_turn>", "model", "\n"]


@pytest.mark.real
@pytest.mark.slow
def test_real_cli_ngram_speculation_equals_plain_greedy(gemma3_folder, capsys, one_thread):
    from mtpctl.cli.main import main

    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
    results = []
    for extra in ([], ["--speculate", "ngram"]):
        code = main(["generate", "-m", "gemma3-270m", "--json", "--no-chat", "--max-new-tokens", "16",
                     "--threads", "1", prompt, *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        results.append(json.loads(out))
    plain, spec = results
    assert spec["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 16
    assert spec["stats"]["tau"] > 1.0  # drafts were accepted, not only proposed
