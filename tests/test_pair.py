"""``mtpctl pair``: verdicts and evidence on tokenizer variants made here from the tiny byte-level
checkpoint (ids 0..255 bytes, 256 <|endoftext|> (UNK, PAD), 257 <|im_start|> (BOS), 258 <|im_end|>
(EOS)), id map files, the drafter a pairing builds, and the CLI."""

import json
import os
from pathlib import Path

import pytest

from helpers import write_tiny_checkpoint
from mtpctl.cli.main import main
from mtpctl.drafters.pairing import (IDENTICAL, INCOMPATIBLE, MAPPED, draft_model_drafter, pair_folders, read_id_map,
                                    write_id_map)
from mtpctl.errors import BadInput


def edit_tokenizer(folder: Path, change) -> Path:
    """Apply ``change`` to the parsed tokenizer.json of ``folder`` and write it back."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = write_tiny_checkpoint(root / "target")
    padded = write_tiny_checkpoint(root / "padded", seed=1, vocab=320)  # 61 padding rows

    added = write_tiny_checkpoint(root / "added", seed=2, vocab=260)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(added))
    tok.add_special_tokens({"pad_token": "<pad>"})  # id 259
    tok.save_pretrained(str(added))

    def rename_a(data):
        vocab = data["model"]["vocab"]
        vocab["AA"] = vocab.pop("A")  # id 32 keeps its place under another string

    changed = edit_tokenizer(write_tiny_checkpoint(root / "changed", seed=3), rename_a)

    def add_bos(data):
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [257], "tokens": ["<|im_start|>"]}}}

    bos = edit_tokenizer(write_tiny_checkpoint(root / "bos", seed=4), add_bos)
    return {"target": target, "padded": padded, "added": added, "changed": changed, "bos": bos}


@pytest.fixture(scope="module")
def pairings(variants):
    names = ["padded", "added", "changed", "bos"]
    return dict(zip(names, pair_folders(variants["target"], [variants[n] for n in names])))


def test_padded_embedding_table_is_identical(pairings):
    p = pairings["padded"]
    assert p.verdict == IDENTICAL and p.usable
    assert p.evidence["draft"]["logits_width"] == 320 and p.evidence["draft"]["padding_rows"] == 61
    assert p.evidence["target"]["logits_width"] == 259 and p.evidence["target"]["padding_rows"] == 0
    assert p.evidence["first_difference"] is None
    assert "61 padding rows past its 259 tokens" in p.reasons[1]
    assert p.id_map == list(range(259)) + [-1] * 61  # padding ids are never proposed


def test_one_added_pad_token_is_mapped(pairings):
    p = pairings["added"]
    assert p.verdict == MAPPED and p.usable
    assert p.evidence["first_difference"] == {"id": 259, "target": None, "draft": "<pad>"}
    assert p.evidence["draft_only_tokens"] == ["<pad>"] and p.evidence["ids_moved"] == 0
    assert p.evidence["special_token_differences"] == [
        "pad: target ('<|endoftext|>', 256), draft ('<pad>', 259)"]
    assert p.id_map == list(range(259)) + [-1]


def test_one_changed_token_string_is_incompatible(pairings):
    p = pairings["changed"]
    assert p.verdict == INCOMPATIBLE and not p.usable and p.id_map is None
    assert p.evidence["first_difference"] == {"id": 32, "target": "A", "draft": "AA"}
    assert any("first differing id 32: 'A' vs 'AA'" in r for r in p.reasons)


def test_a_different_bos_rule_is_incompatible(pairings):
    p = pairings["bos"]
    assert p.verdict == INCOMPATIBLE
    assert p.evidence["target"]["adds_before"] == [] and p.evidence["draft"]["adds_before"] == ["<|im_start|>"]
    assert p.reasons == ["different BOS/EOS rule: the target adds [] before a text, the draft ['<|im_start|>']"]
    assert p.evidence["first_difference"] is None  # same strings at the same ids


def test_id_map_file_round_trip(tmp_path, variants, pairings):
    out = tmp_path / "map.json"
    write_id_map(out, list(pairings.values()))
    data = json.loads(out.read_text())
    assert data["format_version"] == 1 and data["kind"] == "mtpctl-id-map"
    assert [d["verdict"] for d in data["drafts"]] == [IDENTICAL, MAPPED, INCOMPATIBLE, INCOMPATIBLE]
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as a file written by open(), not mkstemp's 0600
    assert read_id_map(out, variants["target"], variants["added"], 259, 260) == list(range(259)) + [-1]
    assert read_id_map(out, variants["target"], variants["bos"], 259, 259) is None
    with pytest.raises(BadInput, match="logits width"):
        read_id_map(out, variants["target"], variants["added"], 259, 300)
    with pytest.raises(BadInput, match="made for target"):
        read_id_map(out, variants["padded"], variants["added"], 259, 260)


def test_pairing_builds_lossless_drafters(variants, pairings):
    """Each verdict's drafter, on the target's own weights where the vocabularies allow, keeps
    plain greedy output; the padded draft never proposes a padding id."""
    from helpers import greedy_reference
    from mtpctl.backends.torch import TorchEngine
    from mtpctl.decode.loop import generate
    from mtpctl.model.decoder import Decoder
    from mtpctl.decode.sampling import SamplingParams
    from mtpctl.decode.stopping import StopChecker

    target = Decoder.from_folder(variants["target"])
    prompt = [257, 72, 105, 10, 258, 10, 257, 97, 10]
    reference = greedy_reference(target, prompt, 24)
    for name in ("padded", "added", "changed"):
        draft = Decoder.from_folder(variants[name])
        drafter = draft_model_drafter(pairings[name], draft, 259, SamplingParams(), 3)
        proposed = []
        original = drafter.propose

        def spy(context, max_tokens, last=None):
            d = original(context, max_tokens, last)
            proposed.extend(d.tokens[1:])
            return d

        drafter.propose = spy
        engine = TorchEngine(target, len(prompt) + 24 + 4)
        result = generate(engine, prompt, StopChecker((), (), 24, str), SamplingParams(), drafter)
        assert result.token_ids == reference, name
        assert proposed and all(0 <= t < 259 for t in proposed), name
    assert draft_model_drafter(pairings["changed"], Decoder.from_folder(variants["changed"]), 259,
                               SamplingParams(), 3).text is not None  # incompatible: text mode


def test_cli_verdicts_json_and_exit_codes(tmp_path, variants, capsys):
    out = tmp_path / "map.json"
    assert main(["pair", str(variants["target"]), str(variants["padded"]), str(variants["added"]),
                 "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [d["verdict"] for d in report["drafts"]] == [IDENTICAL, MAPPED]
    assert report["drafts"][1]["evidence"]["first_difference"] == {"id": 259, "target": None, "draft": "<pad>"}
    assert out.exists()
    assert main(["pair", str(variants["target"]), str(variants["padded"]), str(variants["bos"])]) == 1
    text = capsys.readouterr().out
    assert "identical" in text and "incompatible" in text and "different BOS/EOS rule" in text
    assert main(["pair", str(variants["target"]), str(tmp_path / "missing")]) == 2


def test_generate_and_bench_with_a_draft_model(tmp_path, variants, capsys):
    """generate --speculate draft equals plain greedy (fixed and auto draft length, the padded
    identical draft and the mapped one through --draft-map); bench runs the draft method."""
    target = str(variants["target"])
    assert main(["generate", "-m", target, "--max-new-tokens", "16", "--json", "hi"]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    out = tmp_path / "map.json"
    assert main(["pair", target, str(variants["added"]), "--out", str(out)]) == 0
    capsys.readouterr()
    for extra in (["--draft", str(variants["padded"]), "--draft-len", "2"],
                  ["--draft", str(variants["padded"]), "--draft-len", "auto"],
                  ["--draft", str(variants["added"]), "--draft-map", str(out)]):
        assert main(["generate", "-m", target, "--max-new-tokens", "16", "--json", "--speculate", "draft",
                     *extra, "hi"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["token_ids"] == plain
        assert result["stats"]["draft_tokens"] > 0
    assert result["draft"]["verdict"] == MAPPED and result["draft"]["mode"] == "mapped ids"
    assert main(["generate", "-m", target, "--speculate", "ngram", "--draft-len", "auto", "hi"]) == 2
    assert "needs a fixed draft length, not an automatic one (--draft-len)" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "chat", "prompt": "hello there"}))
    assert main(["bench", "-m", target, "--prompts", str(prompts), "--methods", "plain,draft", "--draft", target,
                 "--max-new-tokens", "12", "--json", str(tmp_path / "b.json")]) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    plain_m, draft_m = report["methods"]
    assert draft_m["method"] == "draft" and draft_m["acceptance_rate"] == 1.0  # the target drafting for itself
    assert draft_m["peak_memory_bytes"] > plain_m["peak_memory_bytes"]  # the draft's weights counted
    assert main(["bench", "-m", target, "--prompts", str(prompts), "--methods", "plain,draft"]) == 2
    assert "needs a draft model" in capsys.readouterr().err


def test_measure_ranks_usable_drafts(variants, capsys):
    assert main(["pair", str(variants["target"]), str(variants["padded"]), str(variants["added"]),
                 str(variants["changed"]), "--measure", "--prompts", "1", "--max-new-tokens", "8",
                 "--draft-len", "2", "--json"]) == 1  # the changed draft is not usable
    rows = json.loads(capsys.readouterr().out)["measure"]
    assert sorted(r["draft"] for r in rows) == sorted([str(variants["padded"]), str(variants["added"])])
    assert rows[0]["tokens_per_s"] >= rows[1]["tokens_per_s"]
    assert all(0 <= r["acceptance_rate"] <= 1 and r["draft_len"] == 2 and r["prompts"] == 1 for r in rows)


def test_target_only_tokens_in_the_context_stop_drafting(variants):
    """Target = the variant with an extra <pad> (id 259), draft = the base tokenizer: mapped; a
    context holding id 259 cannot be shown to the draft, so that call proposes nothing."""
    from mtpctl.drafters.pairing import compare, load_vocabulary
    from mtpctl.model.decoder import Decoder
    from mtpctl.decode.sampling import SamplingParams

    p = compare(load_vocabulary(variants["added"]), load_vocabulary(variants["target"]))
    assert p.verdict == MAPPED and p.evidence["target_only_tokens"] == ["<pad>"]
    drafter = draft_model_drafter(p, Decoder.from_folder(variants["target"]), 260, SamplingParams(), 3)
    assert len(drafter.propose([257, 72, 105, 10], 3).tokens) == 1 + 3  # the root and 3 drafts
    assert drafter.propose([257, 72, 259, 10], 3).tokens == [10]  # the root alone


def test_sampling_with_a_draft_model_is_reproducible(variants, capsys):
    target = str(variants["target"])
    args = ["generate", "-m", target, "--max-new-tokens", "12", "--json", "--speculate", "draft", "--draft",
            str(variants["padded"]), "--temperature", "0.8", "--seed", "3", "hi"]
    outputs = []
    for _ in range(2):
        assert main(args) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) >= 1
