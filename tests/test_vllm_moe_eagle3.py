"""EAGLE-3 heads trained by mtpctl on a Mixture-of-Experts target, served by vLLM's CPU build (``make
vllm-env``, its own virtualenv ``.venv-vllm``) with ``speculative_config={"method": "eagle3"}``.

The target: a tiny random Qwen3-MoE checkpoint written by transformers' own classes (the tests'
:func:`helpers.moe_reference_model`: 3 layers, the middle one dense, 8 experts of which 2 a token),
with two attention heads of 32 values and one KV head (vLLM's CPU attention runs head sizes 32 to 512).
vLLM's ``Qwen3MoeForCausalLM`` implements ``SupportsEagle3``: it returns the residual stream entering
its first layer (id 0) and after each layer (ids 1..n), the ids mtpctl's heads read (3 layers:
mtpctl's default ``(0, 1, 3)``).

``add-heads --kind eagle3`` self-distils heads on 24 templated prompts (float32 responses, 200 steps: a
few seconds); ``export --format speculators`` writes them; vLLM (float32, ``enforce_eager``, the engine
in the worker's process) loads them with its weight check on (no tensor missing or left over) and
decodes three of those prompts (heads this weak draft well only what they were trained on, and the
point here is that both engines compute the same heads on a MoE target, at both chain positions): its
greedy tokens with speculation equal its plain ones (and mtpctl's), drafts are accepted at both
positions, and its accepted tokens per chain position equal mtpctl's with the same top-1 chain within
one token per prompt (mtpctl drafts no further than the tokens left at a generation's end).

Skipped, with the reason, where ``.venv-vllm`` is absent; about 30 s here (two vLLM starts, each in the
worker's process).
"""

import json
import random

import pytest
import torch

from helpers import accepted_by_position, moe_reference_model, write_moe_checkpoints, write_tiny_checkpoint

from mtpctl.bench.vllm_peer import run_worker, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if vllm_python() is None:
    pytest.skip("vLLM's environment (.venv-vllm) is absent: make vllm-env creates it", allow_module_level=True)
transformers = pytest.importorskip("transformers")

NEW = 24
CHAIN = 2  # draft tokens a step: vLLM's num_speculative_tokens, the heads' depth and mtpctl's chain
#: attention shapes vLLM's CPU backend runs (head size 32) in place of the MoE tests' 4 heads of 16
VLLM_HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
WORDS = "apple river stone cloud seven green market window orange winter music paper".split()


def _prompts(rng, n):
    """``n`` prompts of four words drawn by ``rng``."""
    return [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(n)]


def mtpctl_chain(session, heads_dir, prompts):
    """mtpctl's greedy runs with the heads drafting a top-1 chain of CHAIN tokens."""
    from mtpctl.drafters.build import heads_drafter, heads_for
    from mtpctl.drafters.heads.tree import StaticTree

    heads = heads_for(session, heads_dir)
    drafter = heads_drafter(session, heads, StaticTree.from_paths([[0] * d for d in range(1, CHAIN + 1)], CHAIN))
    return [session.generate(p, NEW, drafter=drafter) for p in prompts]


def test_eagle3_heads_on_a_moe_target_run_in_vllm_losslessly_with_mtpctls_acceptance(tmp_path, monkeypatch):
    from mtpctl.backends.torch import TorchSession
    from mtpctl.export.serving import export_serving_heads
    from mtpctl.train.add_heads import add_heads
    from mtpctl.train.settings import TrainSettings

    torch.set_num_threads(1)
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    reference = moe_reference_model("qwen3_moe", **VLLM_HEADS)
    target = write_moe_checkpoints(tmp_path, "qwen3_moe", reference, write_tiny_checkpoint(tmp_path / "tok"))["per_expert"]
    data = tmp_path / "prompts.jsonl"
    texts = _prompts(random.Random(0), 24)
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in texts))
    add_heads(target, "tiny-qwen3-moe", [data], tmp_path / "eagle3", TrainSettings(
        kind="eagle3", num_heads=CHAIN, self_distill=True, distill_dtype="float32", response_tokens=NEW, steps=200,
        lr=1e-2, batch_tokens=512, measure_prompts=0, seed=0), tmp_path / "home")
    config = export_serving_heads("speculators", target, tmp_path / "eagle3", tmp_path / "spec")
    assert config["speculators_config"]["verifier"]["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]

    session = TorchSession(target)  # float32
    prompts = [session.codec.encode_messages([{"role": "user", "content": p}]) for p in texts[:3]]
    request = {"model": str(target), "prompts": prompts, "max_new_tokens": NEW, "threads": 1, "max_model_len": 128,
               "in_process": True}
    plain = [r["token_ids"] for r in run_worker(request, log=tmp_path / "plain.log")["results"]]
    reply = run_worker({**request, "speculative_config": {"method": "eagle3", "model": str(tmp_path / "spec"),
                                                          "num_speculative_tokens": CHAIN}},
                       log=tmp_path / "eagle3.log")  # weights_track on: vLLM's weight check
    assert [r["token_ids"] for r in reply["results"]] == plain  # lossless in vLLM
    ours = mtpctl_chain(session, tmp_path / "eagle3", prompts)
    assert [r.token_ids for r in ours] == [session.generate(p, NEW).token_ids for p in prompts] == plain
    theirs, mine = reply["spec"]["accepted_per_pos"], accepted_by_position(ours, CHAIN)
    assert reply["spec"]["drafts"] > 0 and min(theirs) > 0 and min(mine) > 0, (reply["spec"], mine)
    assert all(abs(a - b) <= len(prompts) for a, b in zip(theirs, mine)), (theirs, mine)
