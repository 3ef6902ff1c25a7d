"""Native MTP layers in the Qwen (``mtp.*``: qwen3_5_text, qwen3_next, the multimodal qwen3_5) and MiMo
(``model.mtp_layers.{k}.*``) layouts, on tiny random float32 checkpoints: bodies written by transformers'
own classes (MiMo's as Qwen2's, config.json renamed: transformers has no ``mimo`` class), one MTP layer
written in the published names.

transformers ignores these tensors, so the reference is built here from transformers' own modules (the
family's decoder layer with ``layer_type="full_attention"``, its RMSNorm class, an ``nn.Linear``, holding
the very weights written) wired as vLLM's ``qwen3_5_mtp.py`` / ``qwen3_next_mtp.py`` / ``mimo_mtp.py``
wire them: row j reads the body's final-normed hidden state ``h_j`` and the embedding of ``x_{j+1}``
(Qwen: ``fc [pre_fc_norm_embedding(e) ; pre_fc_norm_hidden(h)]``; MiMo: ``input_proj [hidden_layernorm(h) ;
token_layernorm(e)]``, position 0's embedding zeroed), runs the layer causally at position j, then the
final norm and the body's lm_head. mtpctl's depth-1 draft at each step equals that row's argmax;
``--speculate mtp`` equals plain greedy; the layer as read writes back bit for bit (offset norms
included); ``add-heads --kind mtp`` refreshes a hybrid body's layer and writes back only ``mtp.*``.
"""

import copy
import json
import shutil

import pytest
import torch
from torch import nn

from helpers import (FAMILY_PROMPTS, cli, copy_tokenizer_files, random_reference_model, randomize_hybrid_weights, run,
                     write_multimodal_checkpoint, write_tiny_checkpoint, assert_one_line_exit_2)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")
pytest.importorskip("transformers.models.qwen3_next")

NEW = 24
LAYOUTS = ("qwen3_5_text", "qwen3_next", "qwen3_5", "mimo")
#: MiMo's tiny Qwen2 body (q/k/v biases, as Qwen2's config class sets them)
MIMO = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=257, eos_token_id=258)


class Reference(nn.Module):
    """One MTP layer as vLLM runs it, from transformers' modules: ``layer`` (the family's decoder layer),
    ``norms`` (embedding, hidden, final: the family's RMSNorm class), ``proj`` ``[H, 2H]``."""

    def __init__(self, layer, norm_cls, hidden: int, eps: float, hidden_first: bool, zero_first: bool):
        super().__init__()
        self.layer, self.proj = layer, nn.Linear(2 * hidden, hidden, bias=False)
        self.enorm, self.hnorm, self.norm = (norm_cls(hidden, eps=eps) for _ in range(3))
        self.hidden_first, self.zero_first = hidden_first, zero_first

    def project(self, h, e, positions):
        """The block's inputs of hidden states ``h`` and embeddings ``e`` ``[1, N, H]`` at ``positions``."""
        if self.zero_first:
            e = e.masked_fill((positions == 0)[..., None], 0)
        parts = (self.hnorm(h), self.enorm(e)) if self.hidden_first else (self.enorm(e), self.hnorm(h))
        return self.proj(torch.cat(parts, dim=-1))

    def block(self, body, x):
        """The layer over rows ``x [1, N, H]`` at positions 0..N-1, causally."""
        positions = torch.arange(x.shape[1])[None]
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        out = self.layer(x, position_embeddings=body.model.rotary_emb(x, positions), attention_mask=mask,
                         position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    def rows(self, body, tokens):
        """The block's inputs ``[1, T - 1, H]`` of rows j = 0..T-2 over ``tokens``: the body's final-normed
        hidden state ``h_j`` and the embedding of ``x_{j+1}``."""
        ids = torch.tensor([tokens])
        h = body.model(input_ids=ids).last_hidden_state[:, :-1]
        return self.project(h, body.model.embed_tokens(ids[:, 1:]), torch.arange(len(tokens) - 1)[None])

    def best(self, body, g):
        """(argmax, top-2 gap) of the logits of block outputs ``g [N, H]``."""
        top = body.lm_head(self.norm(g)).topk(2, dim=-1).values
        return body.lm_head(self.norm(g)).argmax(-1), top[:, 0] - top[:, 1]

    @torch.no_grad()
    def drafts(self, body, tokens):
        """Each row j's (argmax, top-2 gap) over the sequence ``tokens``: the depth-1 draft for ``x_{j+2}``."""
        return self.best(body, self.block(body, self.rows(body, tokens))[0])

    @torch.no_grad()
    def second(self, body, tokens, n: int, first: int):
        """The depth-2 draft after the pending token at position ``n`` (``tokens[n]``) and the depth-1 draft
        ``first``: one more row at position n reading the normed output of row n - 1 (what vLLM's Qwen and
        MiMo predictors return and its proposer feeds back) and the embedding of ``first``."""
        x = self.rows(body, tokens[:n + 1])
        carried = self.norm(self.block(body, x)[:, -1:])
        nxt = self.project(carried, body.model.embed_tokens(torch.tensor([[first]])), torch.tensor([[n]]))
        best, gap = self.best(body, self.block(body, torch.cat((x, nxt), dim=1))[0, -1:])
        return int(best[0]), float(gap[0])

    def tensors(self, prefix: str, names, block: str) -> dict:
        """The layer's tensors under the published ``names`` (embedding norm, hidden norm, projection,
        final norm) and the block's under ``block``, all after ``prefix``."""
        own = dict(zip(names, (self.enorm.weight, self.hnorm.weight, self.proj.weight, self.norm.weight)))
        own.update({block + n: t for n, t in self.layer.state_dict().items()})
        return {prefix + n: t.detach().clone().contiguous() for n, t in own.items()}


def _qwen_reference(body, seed: int) -> Reference:
    """The MTP layer of a transformers Qwen3.5 / Qwen3-Next ``body``: its decoder layer class at index 0 of a
    config whose layer 0 attends fully (vLLM reads index 0 from ``mtp.layers.0``), its RMSNorm (``1 + w``)."""
    module = __import__(type(body).__module__, fromlist=["_"])
    prefix = type(body).__name__[:-len("ForCausalLM")]  # Qwen3_5, Qwen3Next
    config = copy.deepcopy(body.config)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(seed)
    layer = getattr(module, f"{prefix}DecoderLayer")(config, 0)
    ref = Reference(layer, getattr(module, f"{prefix}RMSNorm"), config.hidden_size, config.rms_norm_eps, False, False)
    return randomize_hybrid_weights(ref.eval(), 1.5)


def _mimo_reference(body, seed: int) -> Reference:
    """MiMo's MTP layer on a transformers Qwen2 ``body``: a Qwen2 decoder layer, Qwen2's (plain) RMSNorm,
    the hidden state first, position 0's embedding zeroed."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

    torch.manual_seed(seed)
    ref = Reference(Qwen2DecoderLayer(body.config, 0), Qwen2RMSNorm, body.config.hidden_size,
                    body.config.rms_norm_eps, True, True).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return ref


def _add_tensors(folder, extra: dict, config_update) -> None:
    """``extra`` added to ``folder``'s model.safetensors and its config.json changed by ``config_update``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    config_update(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


QWEN_NAMES = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "fc.weight", "norm.weight")
MIMO_NAMES = ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """layout -> (transformers' body, the MTP :class:`Reference`, the checkpoint folder)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from test_qwen3_5 import reference_model as qwen3_5
    from test_qwen3_5_moe import reference_model as qwen3_5_moe

    root = tmp_path_factory.mktemp("mtp_layouts")
    tokenizer = write_tiny_checkpoint(root / "tokenizer")
    out = {}
    for seed, (layout, body) in enumerate((("qwen3_5_text", qwen3_5()), ("qwen3_next", qwen3_5_moe(next_=True)))):
        ref = _qwen_reference(body, seed + 20)
        folder = root / layout
        body.save_pretrained(str(folder))
        copy_tokenizer_files(tokenizer, folder)
        _add_tensors(folder, ref.tensors("mtp.", QWEN_NAMES, "layers.0."),
                     lambda cfg: cfg.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False))
        out[layout] = (body, ref, folder)
    body, ref, _ = out["qwen3_5_text"]
    folder = root / "qwen3_5"  # the multimodal checkpoint: its count under text_config
    write_multimodal_checkpoint(body, Qwen3_5Config, Qwen3_5ForConditionalGeneration, folder, tokenizer)
    _add_tensors(folder, ref.tensors("mtp.", QWEN_NAMES, "layers.0."),
                 lambda cfg: cfg["text_config"].update(mtp_num_hidden_layers=1))
    out["qwen3_5"] = (body, ref, folder)
    body = random_reference_model("qwen2", **MIMO)
    ref = _mimo_reference(body, 30)
    folder = root / "mimo"
    body.save_pretrained(str(folder))
    copy_tokenizer_files(tokenizer, folder)
    _add_tensors(folder, ref.tensors("model.mtp_layers.0.", MIMO_NAMES, ""),
                 lambda cfg: cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1))
    out["mimo"] = (body, ref, folder)
    return out


def _load(folder, speculate="none", **kw):
    import mtpctl

    return mtpctl.load(str(folder), speculate=speculate, dtype="float32", threads=1, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_drafts_are_vllms_recipe_on_transformers_modules(checkpoints, layout):
    """Two drafts a step: the first is the depth-1 row's argmax, the second the layer run again on its
    normed output and the first draft (rows whose reference top-2 gap is under 1e-3 are not compared)."""
    from mtpctl.drafters.mtp import mtp_drafter

    body, ref, folder = checkpoints[layout]
    llm = _load(folder, speculate_policy="always")
    compared = [0, 0]
    for prompt in FAMILY_PROMPTS[:2]:
        plain = run(llm.session.model, max_new=NEW, prompt=list(prompt)).token_ids
        record = []
        ours = run(llm.session.model, mtp_drafter(llm.session, 2, record=record), max_new=NEW, prompt=list(prompt))
        assert ours.token_ids == plain
        tokens = list(prompt) + plain
        expected, gaps = ref.drafts(body, tokens)
        assert len(record) >= NEW // 3
        for n, drafted in record:  # the row at position n - 1 read the pending token x_n
            if gaps[n - 1] > 1e-3:
                assert drafted[0] == int(expected[n - 1]), (layout, n)
                compared[0] += 1
            if len(drafted) == 2:
                second, gap = ref.second(body, tokens, n, drafted[0])
                if gap > 1e-3:
                    assert drafted[1] == second, (layout, n)
                    compared[1] += 1
    assert compared[0] >= NEW // 2 and compared[1] >= NEW // 2, compared


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mtp_speculation_equals_plain_greedy(checkpoints, layout):
    from mtpctl.decode.session import GenerationRequest

    folder = checkpoints[layout][2]
    expected = [_load(folder).pipeline.generate(list(p), NEW).token_ids for p in FAMILY_PROMPTS]
    llm = _load(folder, "mtp", speculate_policy="always", draft_len=3)
    assert [llm.pipeline.generate(list(p), NEW).token_ids for p in FAMILY_PROMPTS] == expected
    batch = llm.generate_batch([GenerationRequest(list(p), NEW) for p in FAMILY_PROMPTS], max_batch=3)
    assert [r.token_ids for r in batch] == expected


def test_the_layouts_come_from_the_family_descriptions(checkpoints):
    from mtpctl.drafters.mtp import MtpLayers, MtpSettings
    from mtpctl.model.families import FAMILIES
    from mtpctl.model.families.mtp_layouts import DEEPSEEK, ERNIE, MIMO as MIMO_LAYOUT, QWEN
    from mtpctl.train.target import TargetHead

    with_layouts = {t: f.mtp_layout for t, f in FAMILIES.items() if f.mtp_layout is not None}
    assert with_layouts == {"glm4_moe": DEEPSEEK, "deepseek_v3": DEEPSEEK, "qwen3_5_text": QWEN, "qwen3_5": QWEN,
                            "qwen3_5_moe_text": QWEN, "qwen3_5_moe": QWEN, "qwen3_next": QWEN, "mimo": MIMO_LAYOUT,
                            "ernie4_5_moe": ERNIE}
    folder = checkpoints["qwen3_5"][2]
    layers = MtpLayers(TargetHead.from_folder(folder, torch.float32), folder, MtpSettings(zero_first_embedding=True))
    assert layers.prefix == "mtp." and layers.count == 1 and layers.offset == 1.0
    assert layers.settings == MtpSettings(carry="normed", zero_first_embedding=True, own_vocab=True, hidden_first=False)
    assert torch.equal(layers.enorm, 1 + checkpoints["qwen3_5"][1].enorm.weight)  # held as 1 + w, in float32
    assert layers.block.layers[0].deltanet is None and layers.block.layers[0].output_gate  # gated full attention
    folder = checkpoints["qwen3_next"][2]
    layers = MtpLayers(TargetHead.from_folder(folder, torch.float32), folder)
    assert layers.block.layers[0].moe is not None and layers.block.layers[0].shared_expert_gate is not None
    folder = checkpoints["mimo"][2]
    layers = MtpLayers(TargetHead.from_folder(folder, torch.float32), folder)
    assert (layers.prefix, layers.block_prefix, layers.offset) == ("model.mtp_layers.0.", "", 0.0)
    assert layers.settings == MtpSettings(carry="normed", zero_first_embedding=True, own_vocab=True, hidden_first=True)
    assert layers.block.layers[0].qkv_bias is not None  # Qwen2's q/k/v biases


def test_mimo_body_is_qwen2s(checkpoints):
    body, _, folder = checkpoints["mimo"]
    prompt = list(FAMILY_PROMPTS[0])
    with torch.no_grad():
        theirs = body.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert _load(folder).pipeline.generate(prompt, NEW).token_ids == theirs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layer_as_read_writes_back_bit_for_bit(checkpoints, layout, tmp_path):
    """Offset norms (Qwen's ``1 + w``) included: an unchanged norm is written as stored, a changed one as
    its held value less the offset; only the layer's own tensors are replaced."""
    from safetensors.torch import load_file

    from mtpctl.drafters.mtp import MtpLayers
    from mtpctl.model.rewrite import rewrite_checkpoint
    from mtpctl.train.mtp import MtpHead
    from mtpctl.train.target import TargetHead

    folder = checkpoints[layout][2]
    layers = MtpLayers(TargetHead.from_folder(folder, torch.float32), folder)
    head = MtpHead(layers)
    values = {layers.prefix + n: v for n, v in head.tensors().items()}
    assert set(values) == {layers.prefix + n for n in layers.shapes}
    old = load_file(str(folder / "model.safetensors"))
    new = load_file(str(rewrite_checkpoint(folder, tmp_path / "same", values) / "model.safetensors"))
    assert old.keys() == new.keys() and all(torch.equal(old[n], new[n]) and old[n].dtype == new[n].dtype for n in old)
    with torch.no_grad():
        head.hnorm.add_(0.5)
    name = layers.prefix + layers.names["hnorm"]
    written = {layers.prefix + n: v for n, v in head.tensors().items()}[name]
    torch.testing.assert_close(written, old[name] + 0.5)


def test_refresh_on_a_hybrid_body_writes_back_only_mtp_tensors(checkpoints, tmp_path):
    from safetensors.torch import load_file

    from mtpctl.train.mtp_refresh import refresh_mtp
    from mtpctl.train.settings import TrainSettings

    folder = checkpoints["qwen3_5_text"][2]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i} x{i * 7 % 5} y"}) + "\n" for i in range(8)))
    settings = TrainSettings(kind="mtp", num_heads=2, self_distill=True, response_tokens=8, lr=1e-2, steps=3,
                             holdout=0.25, batch_tokens=256, measure_prompts=0)
    summary = refresh_mtp(folder, [data], tmp_path / "out", settings, tmp_path / "home", device="cpu")
    assert len(summary["before"]["acceptance"]) == len(summary["after"]["acceptance"]) == 2
    old, new = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    changed = {n for n in old if not torch.equal(old[n], new[n])}
    assert changed and all(n.startswith("mtp.") for n in changed) and "mtp.fc.weight" in changed, changed
    expected = _load(folder).pipeline.generate(list(FAMILY_PROMPTS[1]), NEW).token_ids
    llm = _load(tmp_path / "out", "mtp", speculate_policy="always")
    assert llm.pipeline.generate(list(FAMILY_PROMPTS[1]), NEW).token_ids == expected


def _variant(folder, out, text: bool = False, drop: str = "", **config):
    """A copy of checkpoint ``folder`` with ``config`` keys set (under text_config with ``text``) and the
    tensor ``drop`` left out."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    _add_tensors(out, {}, lambda cfg: (cfg["text_config"] if text else cfg).update(config))
    if drop:
        tensors = load_file(str(out / "model.safetensors"))
        save_file({n: t for n, t in tensors.items() if n != drop}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    return out


def test_what_is_not_read_is_refused_in_one_line(checkpoints, tmp_path, capsys):
    qwen, mimo = checkpoints["qwen3_5"][2], checkpoints["mimo"][2]
    cases = [(_variant(qwen, tmp_path / "none", text=True, mtp_num_hidden_layers=0),
              "has no MTP layers (mtp_num_hidden_layers is 0)"),
             (_variant(qwen, tmp_path / "own", text=True, mtp_use_dedicated_embeddings=True),
              "config.json sets mtp_use_dedicated_embeddings=True, an MTP layout mtpctl does not read"),
             (_variant(qwen, tmp_path / "lost", drop="mtp.norm.weight"),
              "MTP layer mtp. does not have the published layout (missing 'norm.weight')"),
             (_variant(mimo, tmp_path / "none-mimo", num_nextn_predict_layers=0),
              "has no MTP layers (num_nextn_predict_layers is 0)")]
    for folder, fragment in cases:
        code, out, err = cli(capsys, "generate", "-m", folder, "--max-new-tokens", 4, "--no-chat", "--speculate",
                             "mtp", "--threads", 1, "abc")
        assert_one_line_exit_2(code, out, err, fragment)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc"}) + "\n")
    code, out, err = cli(capsys, "bench", "--model", qwen, "--prompts", prompts, "--baseline", "transformers-mtp")
    assert_one_line_exit_2(code, out, err, "transformers does not read the MTP layers of qwen3_5 checkpoints")
