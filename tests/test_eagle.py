"""EAGLE draft head (kind ``eagle``): the drafter's tree equals the training-time unrolled layer along
every path, decoding with it is lossless, its folder loads strictly, and training reaches every step."""

import json

import pytest
import torch
from helpers import PROMPT, TREES, random_eagle, run

from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.drafter import TargetStep
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.tree import DraftTree
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.eagle import EagleDrafter, EagleHead, layer_config_for
from mtpctl.drafters.heads.folder import load_heads, save_heads
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel


def drafter(model, head, paths):
    return EagleDrafter(head, StaticTree.from_paths(paths, head.cfg.num_heads), lambda ids: model.embed[ids],
                        model.logits)


def test_tree_nodes_equal_the_unrolled_layer_along_their_path(tiny_model):
    """Node at depth d of the drafted tree is the rank-r candidate of draft step d of
    :meth:`EagleHead.forward` (training-time test) run on the prompt plus the node's own path: decode
    and training see the same attention and inputs."""
    head = random_eagle(tiny_model)
    out = TorchEngine(tiny_model, 64).prefill(PROMPT)
    pending = int(out[0].argmax())
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
    draft = drafter(tiny_model, head, paths).propose(PROMPT + [pending], 7, TargetStep(out, 0))
    tree = StaticTree.from_paths(paths, 4)
    node_of = {path: i + 1 for i, path in enumerate(tree.paths)}  # StaticTree.fill: path i is node i + 1
    assert draft.parents == [-1] + [node_of.get(path[:-1], 0) for path in tree.paths]
    n = len(PROMPT)
    for path, node in node_of.items():
        chain = [draft.tokens[node_of[path[:d]]] for d in range(1, len(path))]
        tokens = PROMPT[1:] + [pending] + chain  # row p reads token p + 1
        feats = torch.zeros(1, len(tokens), tiny_model.cfg.hidden_size)
        feats[0, :n] = out.prompt_hidden_states  # rows past the prompt read predicted features only
        outs = head(feats, tiny_model.embed[torch.tensor([tokens])], torch.ones(1, len(tokens), dtype=torch.bool), len(path))
        g = outs[len(path) - 1][0, n - 1 + len(path) - 1]
        ranked = head.logits(g, tiny_model.logits).topk(2).indices.tolist()
        assert draft.tokens[node] == ranked[path[-1]], f"node {path}"


def test_siblings_get_children_from_their_own_token(tiny_model):
    head = random_eagle(tiny_model, seed=1)
    out = TorchEngine(tiny_model, 64).prefill(PROMPT)
    pending = int(out[0].argmax())
    draft = drafter(tiny_model, head, [[0], [1], [0, 0], [1, 0], [0, 1], [1, 1]]).propose(PROMPT + [pending], 6, TargetStep(out, 0))
    assert draft.parents == [-1, 0, 0, 1, 1, 2, 2]
    assert draft.tokens[3:5] != draft.tokens[5:7]  # the children of [0] and of [1] differ


@pytest.mark.parametrize("shape", ["chain", "mixed", "deep-second"])
@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_eagle_decoding_is_lossless(tiny_model, tiny_reference, shape, draft_vocab):
    head = random_eagle(tiny_model, draft_vocab=draft_vocab)
    tree = TREES[shape]
    result = run(tiny_model, drafter(tiny_model, head, tree))
    assert result.token_ids == tiny_reference
    assert sum(result.stats.drafted_per_step) > 0


def reference_dynamic_tree(model, head, out, pending, max_tokens, width):
    """EAGLE-2's dynamic tree computed from the training-time unrolled layer: each node's children's
    log-probabilities from :meth:`EagleHead.forward` run on the prompt plus the node's own path; the
    same expansion and selection rule as the drafter, written out plainly. Returns (tokens, parents)."""
    n = len(PROMPT)

    def children_logp(chain):
        tokens = PROMPT[1:] + [pending] + chain
        feats = torch.zeros(1, len(tokens), model.cfg.hidden_size)
        feats[0, :n] = out.prompt_hidden_states
        outs = head(feats, model.embed[torch.tensor([tokens])], torch.ones(1, len(tokens), dtype=torch.bool),
                    len(chain) + 1)
        logp = head.logits(outs[len(chain)][0, n - 1 + len(chain)], model.logits).float().log_softmax(-1)
        top = logp.topk(width)
        ids = head.token_map[top.indices] if head.token_map is not None else top.indices
        return list(zip(top.values.tolist(), ids.tolist()))

    nodes = []  # (token, parent, score, depth, chain)
    expand = [-1]
    for d in range(1, min(head.cfg.num_heads, max_tokens) + 1):
        children = []
        for parent in expand:
            chain = nodes[parent][4] if parent >= 0 else []
            base = nodes[parent][2] if parent >= 0 else 0.0
            for lp, token in children_logp(chain):
                children.append(len(nodes))
                nodes.append((token, parent, base + lp, d, chain + [token]))
        expand = sorted(children, key=lambda i: (-nodes[i][2], i))[:width]
    kept = sorted(range(len(nodes)), key=lambda i: (-nodes[i][2], nodes[i][3], i))[:max_tokens]
    order = sorted(kept, key=lambda i: (nodes[i][3], i))
    index = {-1: 0, **{i: k + 1 for k, i in enumerate(order)}}
    return [pending] + [nodes[i][0] for i in order], [-1] + [index[nodes[i][1]] for i in order]


@pytest.mark.parametrize("max_tokens", [2, 5, 8])
@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_the_dynamic_tree_is_eagle2s_from_the_unrolled_layer(tiny_model, max_tokens, draft_vocab):
    """The dynamic tree holds the nodes with the highest path log-probability of the ones drafted level by
    level, exactly as computed from the training-time unrolled layer along each path (KV cache, positions
    and masks of the expanded rows agree with training's)."""
    head = random_eagle(tiny_model, seed=2, draft_vocab=draft_vocab)
    out = TorchEngine(tiny_model, 64).prefill(PROMPT)
    pending = int(out[0].argmax())
    static = StaticTree.from_paths(TREES["mixed"] + [[0, 0, 1], [2]], 4)  # 8 nodes: the dynamic tree's size
    d = EagleDrafter(head, static, lambda ids: tiny_model.embed[ids], tiny_model.logits, dynamic=True)
    draft = d.propose(PROMPT + [pending], max_tokens, TargetStep(out, 0))
    width = min(max_tokens, 4)
    assert (draft.tokens, draft.parents) == reference_dynamic_tree(tiny_model, head, out, pending, max_tokens, width)
    assert len(draft) == max_tokens + 1 and (max_tokens < 5 or max(draft.depths) >= 2)  # not only siblings


@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_eagle_decoding_with_a_dynamic_tree_is_lossless(tiny_model, tiny_reference, draft_vocab):
    head = random_eagle(tiny_model, draft_vocab=draft_vocab)
    d = EagleDrafter(head, StaticTree.from_paths(TREES["mixed"], 4), lambda ids: tiny_model.embed[ids],
                     tiny_model.logits, dynamic=True)
    result = run(tiny_model, d)
    assert result.token_ids == tiny_reference
    assert sum(result.stats.drafted_per_step) > 0 and d.fork().dynamic


def test_the_drafter_must_see_every_target_pass(tiny_model):
    head = random_eagle(tiny_model)
    d = drafter(tiny_model, head, [[0]])
    engine = TorchEngine(tiny_model, 64)
    out = engine.prefill(PROMPT)
    pending = int(out[0].argmax())
    d.propose(PROMPT + [pending], 1, TargetStep(out, 0))
    verified = engine.verify(DraftTree.chain([pending]))
    engine.commit([0])
    with pytest.raises(ValueError, match="every target pass"):  # two tokens committed, one row given
        d.propose(PROMPT + [pending, 7, 9], 1, TargetStep(verified, 0, [0]))


def test_sampling_with_eagle_same_seed_same_output(tiny_model):
    """The drafter's state is reset by each prefill, so a reused drafter repeats a seeded run."""
    head = random_eagle(tiny_model)
    sampling = SamplingParams(temperature=0.8, seed=5)
    d = drafter(tiny_model, head, TREES["mixed"])
    a = run(tiny_model, d, sampling=sampling)
    b = run(tiny_model, d, sampling=sampling)
    assert a.token_ids == b.token_ids and sum(a.stats.drafted_per_step) > 0


def test_eagle_folder_round_trip_and_strict_load(tmp_path, tiny_model):
    head = random_eagle(tiny_model, draft_vocab=64)
    save_heads(head, tmp_path)
    loaded = load_heads(tmp_path, torch.float32, tiny_model.dense_lm_head())
    assert isinstance(loaded, EagleHead) and loaded.cfg.layer == head.cfg.layer
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    with pytest.raises(BadInput, match="holds eagle heads"):
        load_heads(tmp_path, kinds=("medusa", "hydra"))
    good = json.loads((tmp_path / "mtp_config.json").read_text())
    for change, error in [({"layer": None}, CorruptModel), ({"layer": [4, 2, 16, 128]}, CorruptModel),
                          ({"layer": {**good["layer"], "attention_heads": 4.0}}, CorruptModel),
                          ({"layer": {**good["layer"], "rope_theta": 0}}, CorruptModel),
                          ({"num_heads": "3"}, CorruptModel), ({"kind": "eagle3"}, CorruptModel),  # no aux_layers
                          ({"kind": "eagle4"}, UnsupportedModel)]:
        (tmp_path / "mtp_config.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(error):
            load_heads(tmp_path, torch.float32, tiny_model.dense_lm_head())
    (tmp_path / "mtp_config.json").write_text(json.dumps(good))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "mtp_heads.safetensors"))
    save_file({**tensors, "token_map": tensors["token_map"].float()}, str(tmp_path / "mtp_heads.safetensors"))
    with pytest.raises(CorruptModel, match="token_map"):
        load_heads(tmp_path, torch.float32, tiny_model.dense_lm_head())


def test_eagle_config_refuses_own_lm_head(tiny_model):
    from mtpctl.train.settings import TrainSettings

    with pytest.raises(ValueError, match="own_lm_head"):
        HeadsConfig("eagle", 2, 0, True, tiny_model.cfg.hidden_size, tiny_model.cfg.vocab_size, layer=layer_config_for(tiny_model.cfg))
    for option in ("own_lm_head", "condition_on_token", "soft_labels"):
        with pytest.raises(BadInput) as caught:
            TrainSettings(kind="eagle", **{option: True}).check()
        assert caught.value.option == option


def test_every_draft_step_gets_a_loss_and_gradients_reach_the_first_step(tiny_model):
    """The loss of the last unrolled step alone reaches the layer through every earlier step's
    predicted feature (training-time test), and the prediction rows are causal: changing a later
    row's token leaves earlier rows' outputs unchanged."""
    head = random_eagle(tiny_model, depth=3)
    head.requires_grad_(True)
    feats = torch.randn(2, 6, tiny_model.cfg.hidden_size, requires_grad=True)
    tokens = tiny_model.embed[torch.randint(0, tiny_model.cfg.vocab_size, (2, 6))]
    valid = torch.ones(2, 6, dtype=torch.bool)
    outs = head(feats, tokens, valid, 3)
    assert len(outs) == 3 and all(o.shape == (2, 6, tiny_model.cfg.hidden_size) for o in outs)
    outs[2][:, 5].sum().backward()
    assert feats.grad[:, :4].abs().sum() > 0  # step 3 at row 5 read the target's rows <= 3
    assert feats.grad[:, 4:].abs().sum() == 0  # ... and nothing of rows 4 and 5's true features
    changed = tokens.clone()
    changed[:, 5] = tiny_model.embed[1]
    again = head(feats.detach(), changed, valid, 3)
    for s in range(3):
        torch.testing.assert_close(again[s][:, :5], outs[s][:, :5].detach())


def test_trainer_rows_labels_and_loss_rows(tiny_model, tmp_path, monkeypatch):
    """Row p of a sequence reads ids[p + 1] and learns pred[p + 1]; step s (0-based) trains rows
    p >= s and p >= loss_from - 1 whose rows p - s + 1 .. p read the target's own predictions
    (ids[q + 1] == pred[q]); groups hold whole sequences."""
    from mtpctl.train.eagle import EagleTrainer
    from mtpctl.train.features import Features
    from mtpctl.train.settings import TrainSettings

    h = tiny_model.cfg.hidden_size
    # the ids follow pred (a self-distilled response: ids[p + 1] == pred[p]) except where noted
    ids = torch.tensor([199, 100, 101, 102, 103, 204, 105, 106, 107])
    feats = Features(torch.randn(9, h), torch.arange(100, 109), torch.tensor([0, 5, 9]), torch.tensor([2, 0]), ids)
    settings = TrainSettings(kind="eagle", num_heads=3, holdout=0.5, batch_tokens=64, epochs=1)
    trainer = EagleTrainer(tiny_model, feats, settings, tmp_path)
    batch = trainer._batch([0, 1])
    assert batch["tokens"].tolist() == [[100, 101, 102, 103], [105, 106, 107, 0]]
    assert batch["labels"].tolist() == [[101, 102, 103, 104], [106, 107, 108, -100]]
    assert torch.equal(batch["next_feats"][0, :4], feats.hidden[1:5]) and torch.equal(batch["feats"][1, :3], feats.hidden[5:8])
    rows = trainer._loss_rows(batch).int().tolist()
    assert rows == [[[0, 1, 1, 1], [1, 1, 1, 0]],   # step 1: sequence 0 from loss_from - 1 = 1 on
                    [[0, 1, 1, 1], [0, 1, 1, 0]],   # step 2: rows p >= 1
                    [[0, 0, 1, 1], [0, 0, 1, 0]]]   # step 3: rows p >= 2
    # off the target's path (plain text): ids[3] != pred[2], so row 2 reads a token no accepted draft
    # gives; a later step that stands on it (step 2 at row 2, step 3 at rows 2 and 3) learns nothing
    off = Features(feats.hidden, feats.pred, feats.offsets, feats.loss_from, ids.clone().index_fill_(0, torch.tensor([3]), 999))
    trainer.feats = off
    assert trainer._loss_rows(trainer._batch([0])).int().tolist() == [[[0, 1, 1, 1]], [[0, 1, 0, 1]], [[0, 0, 0, 0]]]
    assert trainer._loss_rows(trainer._batch([0]), labelled=False).int().tolist()[1:] == [[[0, 1, 0, 1]], [[0, 0, 0, 0]]]
    trainer.feats = feats
    assert trainer._group([0, 1]) == [[1, 0]]  # shortest first, packed under batch_tokens
    trainer.s.batch_tokens = 4  # one sequence a group, until DDP needs one per process
    assert trainer._group([0, 1]) == [[1], [0]]
    monkeypatch.setattr("mtpctl.train.distributed.world_size", lambda: 2)
    assert trainer._group([0, 1]) == [[1, 0]]
    with pytest.raises(BadInput, match="2 processes"):
        trainer._group([0])
    monkeypatch.undo()
    loss, per_step = trainer._loss([0, 1], trainer._label_counts([0, 1]))
    loss.backward()
    assert per_step.shape == (3,) and bool((per_step > 0).all())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.heads.parameters() if p.requires_grad)
