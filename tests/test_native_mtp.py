"""Native MTP layers (``--speculate mtp``) on tiny random glm4_moe and deepseek_v3 checkpoints written by
transformers' classes with one MTP layer in the published layout (``model.layers.{L}.*``: the block,
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``/``head``, ``embed_tokens``).

The reference drafts are transformers' own: ``generate(use_mtp=True, do_sample=False)`` runs
``MTPCandidateGenerator``, which loads the MTP layer from the checkpoint folder through
``MtpModel.from_pretrained`` (its regex of MTP keys comes from the model class's
``_keys_to_ignore_on_load_unexpected``, which names the published models' layer numbers: the test
points it at layer 3 of the tiny models), and each ``get_candidates`` call is recorded: (position of the
pending token, draft token). mtpctl's depth-1 drafter records the same pairs; both greedy generations
accept the same drafts, so their steps line up one for one. A glm4_moe checkpoint with two MTP layers
checks the chain of layers (depth i from layer i-1) against transformers' the same way.
"""

import json
import shutil

import pytest
import torch

from helpers import (assert_one_line_exit_2, cli, copy_tokenizer_files, random_reference_model, run,
                     write_tiny_checkpoint)

from test_glm_deepseek_families import COMMON, EXTRA, MODEL_TYPES, PROMPTS

transformers = pytest.importorskip("transformers")

NEW = 24
LAYERS = COMMON["num_hidden_layers"]


def _reference(model_type: str):
    return random_reference_model(model_type, **{**COMMON, "num_nextn_predict_layers": 1}, **EXTRA[model_type])


def _mtp_tensors(tensors: dict, seed: int, layers: int = LAYERS) -> dict:
    """One MTP layer at ``model.layers.{layers}`` (the body's layer count): a MoE block in the layout
    transformers saves the body's last layer in (fresh random weights), the extras, and copies of the
    embedding and lm_head."""
    gen = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    out = {}
    for name, t in tensors.items():
        if name.startswith(last):
            fresh = torch.randn(t.shape, generator=gen) * 0.2 if t.dim() > 1 else t.clone()
            out[mtp + name[len(last):]] = fresh.to(t.dtype)
    h = tensors["model.norm.weight"].shape[0]
    out.update({mtp + "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * 0.2,
                mtp + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                mtp + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                mtp + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """model_type -> checkpoint folder with one MTP layer (and the tiny tokenizer); plus "plain": one
    without MTP layers."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("native_mtp")
    tokenizer = write_tiny_checkpoint(root / "tokenizer")
    out = {}
    for i, model_type in enumerate(MODEL_TYPES):
        folder = root / model_type
        _reference(model_type).save_pretrained(str(folder))
        assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
        tensors = load_file(str(folder / "model.safetensors"))
        assert not any(n.startswith(f"model.layers.{LAYERS}.") for n in tensors)  # transformers writes none
        save_file({**tensors, **_mtp_tensors(tensors, seed=10 + i)}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        copy_tokenizer_files(tokenizer, folder)
        out[model_type] = folder
    plain = root / "plain"
    shutil.copytree(out["glm4_moe"], plain)
    cfg = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    tensors = load_file(str(plain / "model.safetensors"))
    save_file({n: t for n, t in tensors.items() if not n.startswith(f"model.layers.{LAYERS}.")},
              str(plain / "model.safetensors"), metadata={"format": "pt"})
    out["plain"] = plain
    return out


def _transformers_drafts(folder, model_type, prompt, monkeypatch):
    """transformers' greedy generation with its MTP drafting: (tokens, [(pending position, [draft])])."""
    return transformers_mtp_drafts(folder, prompt, monkeypatch, rf"model\.layers\.{LAYERS}\..*")


def transformers_mtp_drafts(folder, prompt, monkeypatch, mtp_keys=None, new=NEW):
    """transformers' greedy generation of ``new`` tokens with ``use_mtp=True`` (float32): (tokens,
    [(pending position, [draft per MTP layer])]). ``mtp_keys``: the regex of the MTP tensors' names
    ``MtpModel`` reads, set on the loaded model (the published models name their own layer numbers); None:
    the class's own."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if mtp_keys is not None:
        model._keys_to_ignore_on_load_unexpected = [mtp_keys]  # what MtpModel.get_mtp_weights_regex reads
    drafts = []
    original = MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if ids.shape[1] > input_ids.shape[1]:
            drafts.append((input_ids.shape[1] - 1, ids[0, input_ids.shape[1]:].tolist()))
        return ids, logits

    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", recording)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             use_mtp=True, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist(), drafts


def _load(folder, speculate="none", dtype="float32", **kw):
    import mtpctl

    return mtpctl.load(str(folder), speculate=speculate, dtype=dtype, threads=1, **kw)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_depth_one_drafts_equal_transformers_mtp_drafts(folders, model_type, monkeypatch):
    folder = folders[model_type]
    llm = _load(folder, speculate_policy="always")
    for prompt in PROMPTS[:2]:
        assert_depth_one_drafts_match(llm, list(prompt), *_transformers_drafts(folder, model_type, list(prompt),
                                                                               monkeypatch))


def assert_depth_one_drafts_match(llm, prompt, hf_tokens, hf_drafts, new=NEW):
    """mtpctl's greedy tokens with a depth-1 MTP drafter are transformers' ``hf_tokens``, and its draft at
    every step both ran equals transformers' (``hf_drafts``: (position, drafts) pairs)."""
    from mtpctl.drafters.mtp import mtp_drafter

    record = []
    ours = run(llm.session.model, mtp_drafter(llm.session, 1, record=record), max_new=new, prompt=prompt)
    assert ours.token_ids == hf_tokens[:len(ours.token_ids)]
    theirs = dict(hf_drafts)
    common = [n for n, _ in record if n in theirs]
    assert len(common) >= len(hf_drafts) - 1 and len(common) >= new // 4
    assert [dict(record)[n] for n in common] == [theirs[n] for n in common]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_mtp_greedy_and_batches_equal_plain_decoding(folders, model_type, dtype):
    from mtpctl.bench.harness import acceptance_by_position
    from mtpctl.decode.session import GenerationRequest

    folder = folders[model_type]
    plain = _load(folder, dtype=dtype)
    expected = [plain.pipeline.generate(list(p), NEW).token_ids for p in PROMPTS]
    for spec in ("mtp", "mtp+ngram"):
        for depth in (1, 3):
            llm = _load(folder, spec, dtype, speculate_policy="always", draft_len=depth)
            results = [llm.pipeline.generate(list(p), NEW) for p in PROMPTS]
            assert [r.token_ids for r in results] == expected, (spec, depth)
            batch = llm.generate_batch([GenerationRequest(list(p), NEW) for p in PROMPTS], max_batch=len(PROMPTS))
            assert [r.token_ids for r in batch] == expected, (spec, depth)
            if spec == "mtp":
                by_position = acceptance_by_position(results)
                # reported at each depth; a random MTP layer's drafts are rarely right (acceptance near 0
                # here): the real claim is that its drafts equal transformers' (the test above)
                assert len(by_position) == depth and all(0 <= a <= 1 for a in by_position), by_position


def test_sampled_requests_are_seed_stable(folders):
    from mtpctl.decode.sampling import SamplingParams

    folder = folders["glm4_moe"]
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    plain = _load(folder).pipeline.generate(list(PROMPTS[0]), NEW, sampling=sampling).token_ids
    llm = _load(folder, "mtp", speculate_policy="always")
    assert llm.pipeline.generate(list(PROMPTS[0]), NEW, sampling=sampling).token_ids == plain


def test_auto_policy_and_settings(folders):
    from mtpctl.drafters.mtp import MtpSettings

    folder = folders["deepseek_v3"]
    expected = _load(folder).pipeline.generate(list(PROMPTS[1]), NEW).token_ids
    assert _load(folder, "mtp").pipeline.generate(list(PROMPTS[1]), NEW).token_ids == expected
    for settings in (MtpSettings(carry="normed"), MtpSettings(zero_first_embedding=True, own_vocab=False)):
        llm = _load(folder, "mtp", speculate_policy="always", mtp=settings)
        assert llm.pipeline.generate(list(PROMPTS[1]), NEW).token_ids == expected


def test_cli_json_and_a_target_without_mtp_layers(folders, capsys):
    code, out, err = cli(capsys, "generate", "-m", folders["glm4_moe"], "--json", "--max-new-tokens", 8,
                         "--no-chat", "--speculate", "mtp", "--threads", 1, "abcabc")
    assert code == 0, err
    reply = json.loads(out)
    assert reply["speculate"] == "mtp" and reply["stats"]["new_tokens"] == 8 and reply["stats"]["decode_steps"] >= 1
    code, out, err = cli(capsys, "generate", "-m", folders["plain"], "--json", "--max-new-tokens", 8,
                         "--no-chat", "--speculate", "mtp", "abc")
    assert_one_line_exit_2(code, out, err, "has no MTP layers (num_nextn_predict_layers is 0)")


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """A glm4_moe checkpoint with two MTP layers (``num_nextn_predict_layers`` 2: ``model.layers.{L}`` and
    ``model.layers.{L + 1}``, each with fresh random weights) and the tiny tokenizer."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("two_mtp_layers")
    folder = root / "glm4_moe"
    random_reference_model("glm4_moe", **{**COMMON, "num_nextn_predict_layers": 2}, **EXTRA["glm4_moe"]).save_pretrained(
        str(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    first = _mtp_tensors(tensors, seed=21)
    second = _mtp_tensors({**tensors, **first}, seed=22, layers=LAYERS + 1)
    save_file({**tensors, **first, **second}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer_files(write_tiny_checkpoint(root / "tokenizer"), folder)
    return folder


def test_two_layers_draft_depth_two_as_transformers_chains_them(two_layers, monkeypatch):
    """transformers' ``MtpModel`` drafts one token per layer, layer 1 reading layer 0's post-normed output
    at the same row (``carry="normed"``), each layer with its own cache: mtpctl's two drafts a step equal
    its own at every common step."""
    from mtpctl.drafters.mtp import MtpSettings, mtp_drafter, read_mtp_layers

    llm = _load(two_layers, speculate_policy="always")
    layers = read_mtp_layers(llm.session.model, two_layers)
    assert [(m.index, m.prefix) for m in layers] == [(0, f"model.layers.{LAYERS}."), (1, f"model.layers.{LAYERS + 1}.")]
    assert not torch.equal(layers[0].eh_proj, layers[1].eh_proj)
    compared = 0
    for prompt in PROMPTS[:2]:
        hf_tokens, hf_drafts = transformers_mtp_drafts(two_layers, list(prompt), monkeypatch,
                                                       rf"model\.layers\.({LAYERS}|{LAYERS + 1})\..*")
        record = []
        drafter = mtp_drafter(llm.session, 2, MtpSettings(carry="normed"), record=record)
        ours = run(llm.session.model, drafter, max_new=NEW, prompt=list(prompt))
        assert ours.token_ids == hf_tokens[:len(ours.token_ids)]
        theirs = {n: d for n, d in hf_drafts if len(d) == 2}
        common = [(n, d) for n, d in record if n in theirs and len(d) == 2]
        assert len(common) >= NEW // 4
        assert [d for _, d in common] == [theirs[n] for n, _ in common]
        compared += len(common)
    assert compared >= NEW // 2


def test_two_layers_and_recursion_past_them_equal_plain_decoding(two_layers):
    from mtpctl.decode.session import GenerationRequest

    expected = [_load(two_layers).pipeline.generate(list(p), NEW).token_ids for p in PROMPTS]
    for depth in (1, 2, 4):  # 4: two more drafts from the second layer run on its own output
        llm = _load(two_layers, "mtp", speculate_policy="always", draft_len=depth)
        assert [llm.pipeline.generate(list(p), NEW).token_ids for p in PROMPTS] == expected, depth
        batch = llm.generate_batch([GenerationRequest(list(p), NEW) for p in PROMPTS], max_batch=len(PROMPTS))
        assert [r.token_ids for r in batch] == expected, depth


def test_a_refresh_of_two_layers_trains_two_depths_at_least(two_layers, tmp_path):
    from mtpctl.drafters.mtp import MtpLayers
    from mtpctl.errors import BadInput
    from mtpctl.train.mtp_refresh import refresh_mtp
    from mtpctl.train.settings import TrainSettings
    from mtpctl.train.target import TargetHead

    with pytest.raises(BadInput) as caught:
        MtpLayers(TargetHead.from_folder(two_layers, torch.float32), two_layers, index=2)
    assert "declares 2 MTP layer(s): there is no layer 2" in str(caught.value)
    settings = TrainSettings(kind="mtp", num_heads=1, self_distill=True, response_tokens=8, steps=1, measure_prompts=0)
    with pytest.raises(BadInput) as caught:  # refused before any work: the data is not read
        refresh_mtp(two_layers, [tmp_path / "unread.jsonl"], tmp_path / "out", settings, tmp_path / "home", device="cpu")
    assert "has 2 MTP layers" in str(caught.value) and "at least 2 depths (--num-heads 2)" in str(caught.value)
    assert caught.value.option == "num_heads"


def test_positions_taken_back_rebuild_every_layer(two_layers):
    """After positions are taken back (a pass committing rows from before what the drafter holds), the
    two layers draft what a fresh drafter given the same rows drafts."""
    from types import SimpleNamespace

    from mtpctl.decode.drafter import TargetStep
    from mtpctl.drafters.mtp import MtpDrafter, read_mtp_layers

    model = _load(two_layers).session.model
    layers = read_mtp_layers(model, two_layers)
    h = torch.randn(10, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))

    def prefill(rows):
        return TargetStep(SimpleNamespace(prompt_hidden_states=rows, hidden_states=None), row=rows.shape[0] - 1)

    taken_back, fresh = [], []
    drafter = MtpDrafter(layers, 3, record=taken_back)
    drafter.propose(list(range(5, 16)), 3, prefill(h))  # positions 0..9 seen, pending token at 10
    context = list(range(5, 13)) + [200]  # back to position 5; another token at 8
    drafter.propose(context, 3, prefill(h[5:8]))
    MtpDrafter(layers, 3, record=fresh).propose(context, 3, prefill(h[:8]))
    assert drafter.held == 8 and taken_back[1] == fresh[0] and len(fresh[0][1]) == 3
