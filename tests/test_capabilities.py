"""Declared capabilities: the Drafter base and its defaults, StepOutput's and Session's declared
optional parts, and unknown head kinds, drafter parts and trainer kinds refused by name."""

import copy
import json

import pytest
import torch

from helpers import PROMPT, random_heads, run
from mtpctl.backends.graph import GraphStepOutput
from mtpctl.backends.torch import TorchSession, TorchStepOutput
from mtpctl.decode.acceptance import accept_greedy, accept_greedy_together
from mtpctl.decode.drafter import Drafter, aux_layers_of, family, finished, propose_all
from mtpctl.decode.engine import StepOutput
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import GenerationRequest, Session
from mtpctl.decode.tree import DraftTree
from mtpctl.drafters.build import (DraftOptions, LoadedHeads, Parts, build, heads_drafter, heads_for,
                                   lookahead_drafter, member_drafter)
from mtpctl.drafters.heads.config import CONFIG_FILE, KINDS, HeadsConfig
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.drafters.merged import MergedDrafter
from mtpctl.drafters.ngram import NgramDrafter
from mtpctl.errors import BadInput, UnsupportedModel
from mtpctl.model.tokenizer import TextCodec


class Repeat(Drafter):
    """Only what a drafter must have: ``budget`` and ``propose`` (the pending token proposed again,
    mostly wrong, never harmful); every optional part is the base's."""

    budget = 2

    def __init__(self):
        self.calls = 0

    def propose(self, context, max_tokens, last=None):
        self.calls += 1
        return DraftTree.chain([context[-1]] + [context[-1]] * max_tokens)


class Bare(Session):
    """A session that declares nothing beyond the base: no torch model, no extra rows, no fused heads."""

    backend = "bare"


@pytest.fixture(scope="module")
def tiny_session(tiny_folder):
    return TorchSession(tiny_folder)


def test_a_drafter_with_only_propose_has_the_bases_defaults():
    d = Repeat()
    assert d.aux_layers == () and aux_layers_of(d) == ()
    assert d.fork() is d
    assert family(d) == d.family == ("drafter", id(d))
    assert d.finished([1, 2], [3]) is None
    finished(d, [1, 2], [3])
    finished(None, [1, 2], [3])  # plain decoding: nothing to tell
    trees = propose_all([d, d], [([1, 2, 3], 2, None), ([4, 5], 1, None)])
    assert [t.tokens for t in trees] == [[3, 3, 3], [5, 5]] and d.calls == 2


def test_every_drafter_subclasses_the_base():
    from mtpctl.drafters.draft_model import DraftModelDrafter
    from mtpctl.drafters.heads.eagle import EagleDrafter
    from mtpctl.drafters.heads.medusa import MedusaDrafter
    from mtpctl.drafters.hybrid import HybridDrafter
    from mtpctl.drafters.lookahead import LookaheadDrafter
    from mtpctl.drafters.retrieval import RetrievalDrafter

    for cls in (NgramDrafter, RetrievalDrafter, LookaheadDrafter, MergedDrafter, HybridDrafter, MedusaDrafter,
                EagleDrafter, DraftModelDrafter):
        assert issubclass(cls, Drafter), cls


def test_a_drafter_that_overrides_no_hook_decodes_losslessly_alone_merged_and_batched(tiny_model, tiny_reference,
                                                                                         tiny_session):
    assert run(tiny_model, Repeat()).token_ids == tiny_reference
    merged = MergedDrafter([Repeat(), NgramDrafter(3, 1, 2)])
    assert merged.aux_layers == () and merged.fork() is merged
    assert run(tiny_model, merged).token_ids == tiny_reference
    requests = [GenerationRequest(PROMPT[:n], 12) for n in (3, 5, 9)]
    plain = tiny_session.generate_batch(requests, None, 3)
    drafted = tiny_session.generate_batch(requests, Repeat(), 3)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert sum(sum(o.stats.drafted_per_step) for o in drafted) > 0


def test_a_merge_passes_the_finished_hook_to_its_members():
    heard = []

    class Listening(Repeat):
        def finished(self, prompt_ids, output_ids):
            heard.append((list(prompt_ids), list(output_ids)))

    class Scripted:  # the minimal contract, no base class: gets no hook and no error
        budget = 1

        def propose(self, context, max_tokens, last=None):
            return DraftTree(context[-1])

    MergedDrafter([Listening(), Scripted()]).finished([1, 2], [3, 4])
    assert heard == [([1, 2], [3, 4])]


def test_step_outputs_declare_what_they_lack():
    class Rows(StepOutput):
        def __init__(self, logits):
            self.logits, self.hidden_states = logits, torch.zeros(len(logits), 4)

        def __len__(self):
            return len(self.logits)

        def __getitem__(self, i):
            return self.logits[i]

    logits = torch.eye(6)[[1, 2, 5]]  # row 0 -> 1, row 1 -> 2, row 2 -> 5
    out = Rows(logits)
    assert out.greedy(0) is None and out.prefetch([0, 1]) is None
    assert out.logits_timer is None and out.aux_hidden_states is None
    assert out.head_logits is None and out.prompt_hidden_states is None
    tree = DraftTree.chain([0, 1, 2])
    assert accept_greedy(tree, out).tokens == [1, 2, 5]
    assert accept_greedy(tree, logits).tokens == [1, 2, 5]  # a plain tensor reads as rows too
    assert [a.tokens for a in accept_greedy_together([tree], [out])] == [[1, 2, 5]]
    assert issubclass(TorchStepOutput, StepOutput) and issubclass(GraphStepOutput, StepOutput)


def test_sessions_declare_their_capabilities(tiny_folder, tiny_session):
    bare = Bare(tiny_folder, TextCodec(tiny_folder))
    assert bare.model is None and bare.mode == "float32" and bare.policy_mode is None
    assert bare.fused_heads is None and bare.extra_rows is False
    assert tiny_session.model is not None and tiny_session.extra_rows is True and tiny_session.mode == "float32"
    assert tiny_session.policy_mode == ("float32" if tiny_session.placement.native else None)
    with pytest.raises(BadInput, match="lookahead decoding runs on the torch backend") as err:
        lookahead_drafter(bare)
    assert err.value.option == "backend"
    with pytest.raises(BadInput, match="exported without MTP heads"):  # no torch model: heads must be fused
        heads_for(bare, tiny_folder)


def test_an_unknown_head_kind_is_refused_naming_the_known_ones(tiny_session, tmp_path):
    with pytest.raises(ValueError, match="known kinds") as err:
        HeadsConfig("mystery", 3, 1, False, 64, 259)
    assert all(kind in str(err.value) for kind in KINDS)
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"format_version": 1, "kind": "mystery"}))
    with pytest.raises(UnsupportedModel, match="known: medusa, hydra, eagle, eagle3"):
        HeadsConfig.load(tmp_path)
    module = random_heads(tiny_session.model)
    cfg = copy.copy(module.cfg)
    cfg.kind = "mystery"  # past the config's own check: the drafter's choice refuses it too
    with pytest.raises(UnsupportedModel, match="no drafter runs 'mystery' heads") as err:
        heads_drafter(tiny_session, LoadedHeads(cfg, module), StaticTree.from_paths([[0]], 3))
    assert all(kind in str(err.value) for kind in KINDS)


def test_an_unknown_drafter_part_is_refused_naming_the_known_ones(tiny_session):
    with pytest.raises(BadInput, match="unknown drafter") as err:
        build(tiny_session, ("ngram", "mystery"))
    assert "heads" in str(err.value) and err.value.option == "speculate"
    with pytest.raises(BadInput, match="unknown drafter 'mystery'") as err:
        member_drafter(tiny_session, "mystery", DraftOptions(), SamplingParams(), Parts())
    assert "ngram" in str(err.value)


def test_an_unknown_trainer_kind_is_refused_naming_the_known_ones():
    from mtpctl.train.add_heads import TRAINERS, trainer_class
    from mtpctl.train.eagle import Eagle3Trainer

    assert set(TRAINERS) == set(KINDS)
    assert trainer_class("eagle3") is Eagle3Trainer
    with pytest.raises(BadInput, match="no trainer for head kind 'mystery'") as err:
        trainer_class("mystery")
    assert all(kind in str(err.value) for kind in KINDS)
