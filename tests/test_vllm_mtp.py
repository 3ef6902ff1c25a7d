"""A native MTP layer refreshed and written back by ``add-heads --kind mtp``, served by vLLM's CPU build
(``make vllm-env``, its own virtualenv ``.venv-vllm``) with ``speculative_config={"method": "mtp"}``.

The checkpoint: the tiny random glm4_moe of tests/test_native_mtp.py (one MTP layer in the published
layout, ``model.layers.3.*``; two shards and an index as tests/test_mtp_refresh.py writes them), stored
in bfloat16 as GLM ships, with two attention heads of 32 values (vLLM's CPU attention runs head sizes
32 to 512). vLLM runs it twice (float32, ``enforce_eager``, the engine in the worker's process): plain
and with its ``Glm4MoeMTPModel`` drafting chains of three. Its greedy tokens with MTP speculation equal
its plain ones (and mtpctl's), drafts are accepted, and its accepted tokens per chain position equal
mtpctl's ``--speculate mtp`` with vLLM's setting (``MtpSettings(zero_first_embedding=True)``) within one
token per prompt (mtpctl drafts no further than the tokens left at a generation's end).

Skipped, with the reason, where ``.venv-vllm`` is absent; about a minute here (two vLLM starts).
"""

import json
import random

import pytest
import torch

from helpers import accepted_by_position, cli, copy_tokenizer_files, random_reference_model, write_tiny_checkpoint

from mtpctl.bench.vllm_peer import run_worker, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if vllm_python() is None:
    pytest.skip("vLLM's environment (.venv-vllm) is absent: make vllm-env creates it", allow_module_level=True)
transformers = pytest.importorskip("transformers")

NEW = 24
CHAIN = 3  # draft tokens a step: vLLM's num_speculative_tokens, mtpctl's draft_len
#: attention shapes vLLM's CPU backend runs (head size 32) in place of the tests' 4 heads of 16
VLLM_HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def _source(root):
    """The tiny glm4_moe checkpoint with a random MTP layer, bfloat16, in two shards."""
    from safetensors.torch import load_file, save_file

    from test_glm_deepseek_families import COMMON, EXTRA
    from test_mtp_refresh import _shard
    from test_native_mtp import _mtp_tensors

    one = root / "one-shard"
    model = random_reference_model("glm4_moe", **{**COMMON, **EXTRA["glm4_moe"], **VLLM_HEADS,
                                                  "num_nextn_predict_layers": 1})
    model.to(torch.bfloat16).save_pretrained(str(one))
    tensors = load_file(str(one / "model.safetensors"))
    mtp = {n: t.to(torch.bfloat16) for n, t in _mtp_tensors(tensors, seed=10).items()}
    save_file({**tensors, **mtp}, str(one / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer_files(write_tiny_checkpoint(root / "tokenizer"), one)
    return _shard(one, root / "source")


def test_refreshed_mtp_layer_runs_in_vllm_losslessly_with_mtpctls_acceptance(tmp_path, capsys, monkeypatch):
    import mtpctl
    from mtpctl.drafters.mtp import MtpSettings
    from mtpctl.model.weights import read_headers, shard_files

    from test_mtp_refresh import WORDS

    torch.set_num_threads(1)
    source, refreshed = _source(tmp_path), tmp_path / "refreshed"
    rng = random.Random(0)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(4))}) + "\n"
                            for _ in range(120)))
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    code, out, err = cli(capsys, "add-heads", "-m", source, "--kind", "mtp", "--data", data, "--self-distill",
                         "--response-tokens", 24, "--steps", 100, "--lr", 1e-2, "--batch-tokens", 512, "--threads", 1,
                         "--device", "cpu", "--json", "--out", refreshed)
    assert code == 0, err
    assert json.loads(out)["after"]["acceptance"][0] > 0.2
    assert {i.dtype for i in read_headers(shard_files(refreshed)).values()} == {torch.bfloat16}  # as stored

    llm = mtpctl.load(str(refreshed), speculate="mtp", dtype="float32", threads=1, speculate_policy="always",
                      draft_len=CHAIN, mtp=MtpSettings(zero_first_embedding=True))
    rng = random.Random(1)  # prompts the layer was not trained on, in the chat template it was
    prompts = [llm.session.codec.encode_messages([{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(4))}])
               for _ in range(3)]
    request = {"model": str(refreshed), "prompts": prompts, "max_new_tokens": NEW, "threads": 1, "max_model_len": 128,
               "in_process": True}
    plain = [r["token_ids"] for r in run_worker(request)["results"]]
    reply = run_worker({**request, "speculative_config": {"method": "mtp", "num_speculative_tokens": CHAIN}})
    assert [r["token_ids"] for r in reply["results"]] == plain  # lossless in vLLM
    ours = [llm.generate(p, max_new_tokens=NEW) for p in prompts]
    assert [r.token_ids for r in ours] == plain  # and vLLM's greedy tokens are mtpctl's
    theirs, mine = reply["spec"]["accepted_per_pos"], accepted_by_position(ours, CHAIN)
    assert reply["spec"]["drafts"] > 0 and theirs[0] > 0 and mine[0] > 0, (reply["spec"], mine)
    assert all(abs(a - b) <= len(prompts) for a, b in zip(theirs, mine)), (theirs, mine)
