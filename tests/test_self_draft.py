"""The self-draft (``--draft self[:LAYERS]``) on tiny models: a layer subset shares the target's
tensors and leaves it unchanged; every layer kept is the target itself; greedy output is plain
greedy's for any subset and draft length, alone and batched; sampled output follows the target's
distribution; layer specs parse or fail with one clear error; the layer search is measured, stored
as versioned JSON and reused, and a choice made for other weights is refused."""

import json
import re
from collections import Counter

import pytest
import torch

from helpers import (PROMPT, assert_one_line_exit_2, cli, exact_sequence_probs, generate_plain_and, greedy_reference,
                     random_decoder, run, write_tiny_checkpoint)
from mtpctl.backends.torch import TorchEngine, TorchSession
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import GenerationRequest
from mtpctl.decode.tree import DraftTree
from mtpctl.drafters import self_draft
from mtpctl.drafters.build import DraftOptions, build
from mtpctl.drafters.draft_model import DraftModelDrafter
from mtpctl.drafters.self_draft import format_layers, layer_subset, parse_layers
from mtpctl.errors import BadInput
from stats_util import chi_square_rejects


@pytest.fixture(scope="module")
def model():
    return random_decoder(seed=3, num_hidden_layers=4)


@pytest.fixture(scope="module")
def reference(model):
    return greedy_reference(model, PROMPT, 40)


def test_a_layer_subset_shares_the_targets_tensors_and_leaves_it_alone(model):
    sub = layer_subset(model, (0, 2, 3))
    assert sub.cfg.num_hidden_layers == 3 and model.cfg.num_hidden_layers == 4
    assert [layer.index for layer in sub.layers] == [0, 1, 2] and [layer.index for layer in model.layers] == [0, 1, 2, 3]
    assert sub.layers[1].qkv.data_ptr() == model.layers[2].qkv.data_ptr()
    assert sub.embed.data_ptr() == model.embed.data_ptr() and sub.norm.data_ptr() == model.norm.data_ptr()
    assert len(model.layers) == 4 and sub.new_cache(8).k.shape[0] == 3


def test_every_layer_kept_is_the_target(model):
    tree = DraftTree.chain(PROMPT)
    full = TorchEngine(model, 20).verify(tree).logits
    assert torch.equal(TorchEngine(layer_subset(model, range(4)), 20).verify(tree).logits, full)


@pytest.mark.parametrize("layers", [(0,), (0, 3), (1, 2, 3)])
@pytest.mark.parametrize("draft_len", [1, 3, None])
def test_greedy_self_draft_is_plain_greedy(model, reference, layers, draft_len):
    drafter = DraftModelDrafter(layer_subset(model, layers), model.cfg.vocab_size, draft_len=draft_len)
    result = run(model, drafter)
    assert result.token_ids == reference
    assert result.stats.draft_tokens > 0


def test_sampled_self_draft_keeps_the_target_distribution():
    """The first 3 sampled tokens with a one-layer self-draft that samples and reports its q follow
    the exact distribution of plain sampling (chi-square), and not another temperature's."""
    model = random_decoder(seed=5, vocab=5, max_pos=32)
    prompt, n = [1, 2, 1, 2, 1], 3
    params = SamplingParams(temperature=1.0, top_k=4)
    drafter = DraftModelDrafter(layer_subset(model, (1,)), 5, params, draft_len=3, seed=123)
    counts = Counter()
    for seed in range(1000):
        result = run(model, drafter, max_new=n + 1, sampling=SamplingParams(1.0, 4, 1.0, seed), prompt=prompt)
        counts[tuple(result.token_ids[:n])] += 1
    assert not chi_square_rejects(counts, exact_sequence_probs(model, prompt, n, params))
    assert chi_square_rejects(counts, exact_sequence_probs(model, prompt, n, SamplingParams(temperature=0.5)))


def test_layer_specs_parse_and_print():
    assert parse_layers("0-2, 5,7-9", 12) == (0, 1, 2, 5, 7, 8, 9)
    assert parse_layers("3,1", 4) == (1, 3)
    assert format_layers((0, 1, 2, 5, 7, 8, 9)) == "0-2,5,7-9"


@pytest.mark.parametrize("text, fragment", [
    ("0-40", "has 30 layers (0-29), not layer 30"), ("5-2", "reversed"), ("1,1", "layer 1 is named twice"),
    ("a", "numbers and ranges"), ("", "numbers and ranges"), ("1-", "numbers and ranges"),
])
def test_bad_layer_specs_are_one_clear_error(text, fragment):
    with pytest.raises(BadInput, match=re.escape(fragment)) as err:
        parse_layers(text, 30)
    assert err.value.option == "draft_model"


@pytest.fixture(scope="module")
def tiny_session(tiny_folder):
    return TorchSession(tiny_folder)


def test_self_draft_in_a_batch_is_each_request_alone(tiny_session):
    drafter = build(tiny_session, "draft", DraftOptions(draft_model="self:1", draft_len=3))
    assert drafter.describe()["mode"] == "ids (self-draft: layers 1 of 2)" and drafter.weight_bytes == 0
    ids = [tiny_session.encode(text) for text in ("hello there", "count: 1 2 3 1 2 3", "x y z")]
    requests = [GenerationRequest(i, n) for i, n in zip(ids, (20, 30, 12))]
    batched = tiny_session.generate_batch(requests, drafter, max_batch=2)
    for request, outcome in zip(requests, batched):
        assert outcome.token_ids == tiny_session.generate(request.prompt_ids, request.max_new_tokens).token_ids
        assert outcome.stats.draft_tokens > 0


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_the_layer_search_is_stored_and_reused(tmp_path, home, monkeypatch):
    session = TorchSession(write_tiny_checkpoint(tmp_path / "tiny4", num_hidden_layers=4))
    lines = []
    drafter = build(session, "draft", DraftOptions(draft_model="self"), progress=lines.append)
    path = self_draft.choice_path(session)
    record = json.loads(path.read_text())
    assert record["kind"] == "mtpctl-self-draft" and record["format_version"] == 1
    assert record["target_sha256"] == session.target_hash() and record["mode"] == "float32"
    assert [c["kept"] for c in record["candidates"]] == [3, 2, 1]
    assert all(0 <= c["agreement"] <= 1 for c in record["candidates"]) and len(record["importance"]) == 4
    assert drafter.describe()["layers"] == record["layers"] and len(lines) == 2 and str(path) in lines[0]
    monkeypatch.setattr(self_draft, "search_layers", lambda session: pytest.fail("searched again"))
    again = build(session, "draft", DraftOptions(draft_model="self"))
    assert again.describe()["layers"] == record["layers"]
    assert build(session, "draft", DraftOptions(draft_model=f"self:{path}")).describe()["layers"] == record["layers"]
    path.write_text(json.dumps({**record, "target_sha256": "0" * 64}))
    with pytest.raises(BadInput, match="made for other weights") as err:
        build(session, "draft", DraftOptions(draft_model="self"))
    assert err.value.option == "draft_model"


def test_the_search_is_deterministic(tiny_session):
    assert self_draft.search_layers(tiny_session) == self_draft.search_layers(tiny_session)


def test_cli_self_draft_is_plain_greedy_and_names_itself(capsys, tiny_folder, home):
    plain, spec, err = generate_plain_and(capsys, tiny_folder, "--speculate", "draft", "--draft", "self:1",
                                          "--draft-len", "auto")
    assert spec["token_ids"] == plain["token_ids"] and spec["draft"]["mode"] == "ids (self-draft: layers 1 of 2)"
    assert "self-draft: layers 1 of 2" in err


@pytest.mark.parametrize("args, fragment", [
    (["--speculate", "draft", "--draft", "self:7"], "the model has 2 layers (0-1), not layer 7 (--draft)"),
    (["--speculate", "draft", "--draft", "self:1-0"], "reversed (--draft)"),
    (["--speculate", "draft", "--draft", "self:x"], "numbers and ranges"),
    (["--speculate", "draft", "--draft", "self", "--draft-map", "m.json"], "takes no id map (--draft-map)"),
    (["--speculate", "ngram", "--draft", "self:1"], "(--draft)"),
])
def test_cli_bad_self_drafts_are_one_line_exit_2(capsys, tiny_folder, home, args, fragment):
    assert_one_line_exit_2(*cli(capsys, "generate", "-m", tiny_folder, *args, "hi"), fragment)


def test_a_gemma3_self_draft_keeps_its_layers_windows_and_ropes():
    """Gemma 3's layers carry their own sliding window and rope: a subset keeps each kept layer's, so
    its draft over a context longer than the window is the subset's own model, and greedy stays
    plain greedy."""
    from helpers import GEMMA3_TINY as TINY, random_state_dict
    from mtpctl.model.config import DecoderConfig
    from mtpctl.model.decoder import Decoder

    cfg = DecoderConfig.from_dict({"model_type": "gemma3_text", **TINY})
    model = Decoder(cfg)
    model.load_hf_tensors(random_state_dict(cfg, seed=2))
    sub = layer_subset(model, (1, 3))
    assert sub.cfg.layer_windows == (cfg.layer_windows[1], cfg.layer_windows[3]) == (None, 4)
    assert sub.local_rope == (False, True)
    prompt = [5, 17, 42, 9, 3, 50, 7, 5, 17, 60]
    result = run(model, DraftModelDrafter(sub, cfg.vocab_size, draft_len=3), max_new=30, prompt=prompt)
    assert result.token_ids == greedy_reference(model, prompt, 30) and result.stats.draft_tokens > 0
