"""EAGLE-3 heads (kind ``eagle3``): the target's passes return the aux layers' residual streams, the
drafter's tree equals the training-time unrolled layer along every path, decoding with it is lossless
(the tiny model here, the real SmolLM2 in test_real_eagle3), the folder loads strictly, and the
trainer's rows and loss reach every parameter."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import PROMPT, TREES, perturbed

from mtpctl.backends.torch import TorchEngine, TorchSession
from mtpctl.decode.cost_table import measure_draft
from mtpctl.decode.drafter import TargetStep
from mtpctl.decode.loop import generate
from mtpctl.decode.policy import AlwaysDraft
from mtpctl.decode.tree import DraftTree
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.eagle3 import Eagle3Drafter, Eagle3Head, aux_features, default_aux_layers, eagle3_layer_config
from mtpctl.drafters.heads.folder import load_heads, save_heads
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.errors import CorruptModel
from mtpctl.model.decoder import _rms_norm
from mtpctl.model.linears import tiles_take


def random_eagle3(model, depth=4, seed=0, draft_vocab=0, norm_before_residual=False):
    layer = eagle3_layer_config(model.cfg)
    layer.norm_before_residual = norm_before_residual
    cfg = HeadsConfig("eagle3", depth, 0, True, model.cfg.hidden_size, model.cfg.vocab_size, draft_vocab, layer=layer)
    token_map = torch.arange(0, 2 * draft_vocab, 2) if draft_vocab else None
    torch.manual_seed(seed)
    return perturbed(Eagle3Head(cfg, torch.float32, model.dense_lm_head().float(), token_map), seed)


def drafter(model, head, paths):
    return Eagle3Drafter(head, StaticTree.from_paths(paths, head.cfg.num_heads), lambda ids: model.embed[ids])


def decode(model, d, max_new=40, sampling=SamplingParams()):
    engine = TorchEngine(model, len(PROMPT) + max_new + d.budget + 1, aux_layers=d.head.cfg.layer.aux_layers)
    return generate(engine, PROMPT, StopChecker(set(), (), max_new, lambda ids: ""), sampling, d)


def test_default_aux_layers_are_the_engines():
    assert default_aux_layers(30) == (2, 15, 27)  # SmolLM2-135M: vLLM's (2, n // 2, n - 3)
    assert default_aux_layers(2) == (0, 1, 2)


def test_passes_return_the_residual_stream_after_each_aux_layer(tiny_model):
    """Layer id L is the stream after L layers (0: the embeddings; the last one, normed, is the
    final hidden state), for prefill and verify passes alike."""
    n = tiny_model.cfg.num_hidden_layers
    engine = TorchEngine(tiny_model, 64, aux_layers=(0, 1, n))
    out = engine.prefill(PROMPT)
    assert set(out.aux_hidden_states) == {0, 1, n}
    assert torch.equal(out.aux_hidden_states[0], tiny_model.embed[torch.tensor(PROMPT)])
    final = _rms_norm(out.aux_hidden_states[n], tiny_model.norm, tiny_model.cfg.rms_norm_eps)
    torch.testing.assert_close(final, out.prompt_hidden_states)
    assert not torch.equal(out.aux_hidden_states[1], out.aux_hidden_states[n])
    step = engine.verify(StaticTree.from_paths([[0], [0, 0]], 2).fill(3, {(0,): 4, (0, 0): 5}, 2))
    assert step.aux_hidden_states[1].shape == (3, tiny_model.cfg.hidden_size)
    assert TorchEngine(tiny_model, 64).prefill(PROMPT).aux_hidden_states is None


def test_tree_nodes_equal_the_unrolled_layer_along_their_path(tiny_model):
    head = random_eagle3(tiny_model)
    layers = head.cfg.layer.aux_layers
    out = TorchEngine(tiny_model, 64, aux_layers=layers).prefill(PROMPT)
    pending = int(out[0].argmax())
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
    draft = drafter(tiny_model, head, paths).propose(PROMPT + [pending], 7, TargetStep(out, 0))
    tree = StaticTree.from_paths(paths, 4)
    node_of = {path: i + 1 for i, path in enumerate(tree.paths)}
    n = len(PROMPT)
    for path, node in node_of.items():
        chain = [draft.tokens[node_of[path[:d]]] for d in range(1, len(path))]
        tokens = PROMPT[1:] + [pending] + chain
        aux = torch.zeros(1, len(tokens), len(layers) * tiny_model.cfg.hidden_size)
        aux[0, :n] = aux_features(out.aux_hidden_states, layers)  # rows past the prompt read outputs only
        outs = head(aux, tiny_model.embed[torch.tensor([tokens])], torch.ones(1, len(tokens), dtype=torch.bool), len(path))
        g = outs[len(path) - 1][0, n - 1 + len(path) - 1]
        ranked = head.logits(g).topk(2).indices.tolist()
        assert draft.tokens[node] == ranked[path[-1]], f"node {path}"


@pytest.mark.parametrize("shape", ["chain", "mixed", "deep-second"])
@pytest.mark.parametrize("draft_vocab,before", [(0, False), (64, True)])
def test_eagle3_decoding_is_lossless(tiny_model, tiny_reference, shape, draft_vocab, before):
    head = random_eagle3(tiny_model, draft_vocab=draft_vocab, norm_before_residual=before)
    result = decode(tiny_model, drafter(tiny_model, head, TREES[shape]))
    assert result.token_ids == tiny_reference
    assert sum(result.stats.drafted_per_step) > 0


@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_eagle3_decoding_with_a_dynamic_tree_is_lossless(tiny_model, tiny_reference, draft_vocab):
    head = random_eagle3(tiny_model, draft_vocab=draft_vocab)
    d = Eagle3Drafter(head, StaticTree.from_paths(TREES["mixed"], head.cfg.num_heads),
                      lambda ids: tiny_model.embed[ids], dynamic=True)
    result = decode(tiny_model, d)
    assert result.token_ids == tiny_reference
    assert sum(result.stats.drafted_per_step) > 0 and d.fork().dynamic and d.fork().aux_layers == d.aux_layers


def test_drafting_without_the_aux_layers_is_an_error(tiny_model):
    head = random_eagle3(tiny_model)
    out = TorchEngine(tiny_model, 64).prefill(PROMPT)  # no aux_layers
    with pytest.raises(ValueError, match="needs the target's layers"):
        drafter(tiny_model, head, [[0]]).propose(PROMPT + [1], 1, TargetStep(out, 0))


def test_eagle3_folder_round_trip_and_strict_load(tmp_path, tiny_model):
    head = random_eagle3(tiny_model, draft_vocab=64)
    save_heads(head, tmp_path)
    loaded = load_heads(tmp_path, torch.float32, tiny_model.dense_lm_head(), blocked=True)
    assert isinstance(loaded, Eagle3Head) and loaded.cfg.layer == head.cfg.layer
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    g = torch.randn(3, tiny_model.cfg.hidden_size)
    torch.testing.assert_close(loaded.logits(g), head.logits(g))  # the blocked lm_head holds the loaded weights
    good = json.loads((tmp_path / "mtp_config.json").read_text())
    for change in [{"own_lm_head": False}, {"layer": {**good["layer"], "aux_layers": []}},
                   {"layer": {**good["layer"], "aux_layers": [1, "2"]}},
                   {"layer": {**good["layer"], "norm_before_residual": 1}}]:
        (tmp_path / "mtp_config.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(CorruptModel):
            load_heads(tmp_path, torch.float32, tiny_model.dense_lm_head())


def test_every_draft_step_reads_the_previous_output_and_gradients_reach_fc(tiny_model):
    head = random_eagle3(tiny_model, depth=3).requires_grad_(True)
    h = tiny_model.cfg.hidden_size
    aux = torch.randn(2, 6, 3 * h, requires_grad=True)
    tokens = tiny_model.embed[torch.randint(0, tiny_model.cfg.vocab_size, (2, 6))]
    outs = head(aux, tokens, torch.ones(2, 6, dtype=torch.bool), 3)
    outs[2][:, 5].sum().backward()
    assert aux.grad[:, :4].abs().sum() > 0 and aux.grad[:, 4:].abs().sum() == 0
    assert head.fc.grad.abs().sum() > 0 and head.embed_norm.grad.abs().sum() > 0


def test_trainer_reads_the_aux_layers_and_trains_the_heads_own_lm_head(tiny_model, tmp_path):
    """The first draft step reads ``feats.aux``; the loss is the tokens' cross-entropy alone (a
    feature regression would need next_feats); every parameter, lm_head included, gets a gradient."""
    from mtpctl.errors import BadInput
    from mtpctl.train.eagle import Eagle3Trainer
    from mtpctl.train.features import Features
    from mtpctl.train.settings import TrainSettings

    h = tiny_model.cfg.hidden_size
    ids = torch.tensor([199, 100, 101, 102, 103, 204, 105, 106, 107])
    hidden, aux = torch.randn(9, h), torch.randn(9, 3 * h)
    feats = Features(hidden, torch.arange(100, 109), torch.tensor([0, 5, 9]), torch.tensor([2, 0]), ids, aux=aux)
    settings = TrainSettings(kind="eagle3", num_heads=2, holdout=0.5, batch_tokens=64, epochs=1, draft_vocab=50)
    trainer = Eagle3Trainer(tiny_model, feats, settings, tmp_path)
    assert trainer.hcfg.own_lm_head and trainer.hcfg.layer.aux_layers == [0, 1, 2]
    batch = trainer._batch([0, 1])
    assert torch.equal(batch["feats"][0, :4], aux[0:4]) and torch.equal(batch["feats"][1, :3], aux[5:8])
    loss, per_step = trainer._loss([0, 1], trainer._label_counts([0, 1]))
    loss.backward()
    assert per_step.shape == (2,) and bool((per_step > 0).all())
    grads = {n: p.grad for n, p in trainer.heads.named_parameters()}
    assert "lm_head" in grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    with pytest.raises(BadInput, match="aux layers"):
        Eagle3Trainer(tiny_model, Features(hidden, feats.pred, feats.offsets, feats.loss_from, ids), settings, tmp_path)


def test_a_head_trained_on_the_targets_output_gets_drafts_accepted_and_stays_lossless(tiny_model, tiny_reference, tmp_path):
    """Heads overfitted to the target's own continuation of PROMPT draft it: long accepted paths
    exercise the drafter's cache across multi-token commits (random heads are almost never right)."""
    from mtpctl.train.distill import TrainSequence
    from mtpctl.train.eagle import Eagle3Trainer
    from mtpctl.train.features import compute_features
    from mtpctl.train.settings import TrainSettings

    settings = TrainSettings(kind="eagle3", num_heads=3, aux_layers=[0, 1, 2], epochs=150, lr=1e-2, batch_tokens=256)
    feats = compute_features(tiny_model, [TrainSequence(PROMPT + tiny_reference, len(PROMPT))], settings)
    trainer = Eagle3Trainer(tiny_model, feats, settings, tmp_path)
    trainer.train(resume=False)
    head = trainer.heads.requires_grad_(False)
    result = decode(tiny_model, drafter(tiny_model, head, TREES["mixed"]))
    assert result.token_ids == tiny_reference
    assert result.stats.accepted_tokens >= 15 and max(result.stats.accepted_per_step) >= 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_drafter_cost_measured_on_first_use_times_an_eagle3_step(tiny_folder, dtype):
    """The auto policy's first-use measurement (mtpctl.decode.cost_table.measure_draft) lets each fork
    read the prompt's prefill before timing a step: an EAGLE-3 drafter refuses a step it has not
    seen the prompt for."""
    session = TorchSession(tiny_folder, dtype)
    head = random_eagle3(session.model).to(session.model.dtype)
    cost = measure_draft(session, drafter(session.model, head, TREES["mixed"]), vocab=session.vocab_size, reps=2)
    assert cost.call_ms + cost.row_ms > 0 and min(cost.call_ms, cost.row_ms) >= 0


@pytest.mark.skipif(not tiles_take(torch.bfloat16, (64, 64)), reason="the native kernels do not build here")
def test_a_decoding_bfloat16_head_runs_its_products_on_tiles_and_trains_on_torch(tiny_model):
    """A decoding head (``blocked``) of bfloat16 weights: every product of the layer and lm_head on the
    native tiles, each equal to torch's to bfloat16 rounding; with autograd on (training), torch's."""
    head = random_eagle3(tiny_model, draft_vocab=8).to(torch.bfloat16)
    head.blocked = True
    assert set(head.tiles()) == {"fc", "qkv", "o_proj", "gate_up", "down", "lm_head"}
    for name, tiled in head.tiles().items():
        weight = getattr(head, name)
        x = torch.randn(3, weight.shape[1]).to(torch.bfloat16)
        with torch.no_grad():
            torch.testing.assert_close(head.linear(x, name).float(), F.linear(x, weight).float(), rtol=0.02, atol=0.02)
            assert torch.equal(head.linear(x, name), tiled(x))
    x = torch.randn(2, head.qkv.shape[1]).to(torch.bfloat16)
    head.requires_grad_(True)
    out = head.linear(x, "qkv")
    assert out.requires_grad and torch.equal(out, F.linear(x, head.qkv))  # training: torch's product, with gradients


class EveryThirdStep(AlwaysDraft):
    """A policy that lets the row draft its whole budget on every third step only."""

    def __init__(self):
        self.steps = 0

    def draft_sizes(self, rooms, rows):
        self.steps += 1
        return list(rooms) if self.steps % 3 == 0 else [0] * len(rooms)


class Recorded:
    """A drafter that records the trees it proposes; ``eager``: it runs the layer every step (drafting
    its whole budget and keeping the tree only where the step asks for one)."""

    def __init__(self, inner, eager=False):
        self.inner, self.eager, self.trees, self.budget = inner, eager, [], inner.budget
        self.aux_layers = inner.aux_layers

    def fork(self):
        return Recorded(self.inner.fork(), self.eager)

    def propose(self, context, max_tokens, last=None):
        eager = self.eager and last is not None and max_tokens <= 0
        tree = self.inner.propose(context, self.budget if eager else max_tokens, last)
        if max_tokens <= 0:
            return DraftTree(context[-1])
        self.trees.append((len(context), tree.tokens))
        return tree


def test_steps_that_draft_nothing_keep_their_rows_for_the_next_draft(tiny_model, tiny_reference):
    """Rows committed on steps where the policy drafts nothing run together at the next step that
    drafts: the same trees as running them every step, and the output stays plain greedy's."""
    runs = {}
    for eager in (False, True):
        d = Recorded(drafter(tiny_model, random_eagle3(tiny_model, draft_vocab=64), TREES["mixed"]), eager)
        engine = TorchEngine(tiny_model, len(PROMPT) + 40 + d.budget + 1, aux_layers=d.aux_layers)
        result = generate(engine, PROMPT, StopChecker(set(), (), 40, lambda ids: ""), SamplingParams(), d,
                          policy=EveryThirdStep())
        assert result.token_ids == tiny_reference
        runs[eager] = d.trees
    assert len(runs[False]) >= 5 and runs[False] == runs[True]
