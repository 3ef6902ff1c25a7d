"""Plain decode steps replayed as CUDA graphs (mtpctl.backends.step_graphs), checked on the CPU under the
virtual CUDA device with an op tape standing in for the graph (tests/virtual_cuda.py ``TapeCapture``:
a replay reruns the recorded torch calls on the recorded tensors and no Python between them, so a step
that depends on a host value that changes from step to step replays it stale)."""

from __future__ import annotations

import pytest

from mtpctl.backends import step_graphs
from mtpctl.backends import torch as torch_backend
from mtpctl.decode.attention import HEAD_BLOCK
from mtpctl.errors import UnsupportedModel
from virtual_cuda import TapeCapture, virtual_cuda

NEW_TOKENS = 40  # past two head lengths after the prompt: three graphs


def _graph_session(folder, monkeypatch, mode, dtype="float32"):
    tape = TapeCapture(mode)
    monkeypatch.setattr(step_graphs, "CudaCapture", lambda: tape)
    return torch_backend.TorchSession(folder, dtype, device="cuda", kernels="torch", cuda_graphs=True), tape


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_steps_give_the_eager_steps_tokens(tiny_folder, monkeypatch, dtype):
    """Plain greedy with its decode steps replayed from one graph per head length gives the eager steps'
    tokens, over prompts whose steps cross head lengths; a capture neither syncs nor copies to the device,
    and each step brings only its token's id to the host."""
    with virtual_cuda() as mode:
        eager = torch_backend.TorchSession(tiny_folder, dtype, device="cuda", kernels="torch")
        graphs, tape = _graph_session(tiny_folder, monkeypatch, mode, dtype)
        prompts = [graphs.encode(text) for text in ("count: 1 2 3 1 2 3", "a", "the quick brown fox jumps")]
        want = [eager.generate(p, NEW_TOKENS).token_ids for p in prompts]
        engines = []
        new_engine = graphs.new_engine
        monkeypatch.setattr(graphs, "new_engine", lambda *a, **k: engines.append(new_engine(*a, **k)) or engines[-1])
        mode.events.clear()
        got = [graphs.generate(p, NEW_TOKENS).token_ids for p in prompts]
    assert got == want
    for prompt, engine in zip(prompts, engines):
        steps = NEW_TOKENS - 1
        heads = {max(0, (p - HEAD_BLOCK) // HEAD_BLOCK) for p in range(len(prompt), len(prompt) + steps)}
        assert engine.graphs.captures == len(heads) and engine.graphs.replays == steps - len(heads)
        assert len(engine.graphs._steps) == min(2, len(heads))  # the graphs of heads left behind are dropped
    assert not [e for e in tape.capture_events if e.kind in ("sync", "h2d", "mixup")], tape.capture_events
    syncs = [e for e in mode.events if e.kind == "sync"]
    assert all(e.detail == "int64[1]" for e in syncs), {e.detail for e in syncs}
    assert not [e for e in mode.events if e.kind == "mixup"]
    copies = {e.what for e in mode.events if e.kind == "h2d" and "step_graphs" in e.site}
    assert copies == {"host tensor copied in copy_ non_blocking"}, copies  # the buffers' fills


def test_a_replayed_step_launches_a_handful_of_kernels_from_the_host(tiny_folder, monkeypatch):
    """What the host launches for a replayed plain step's pass (two fills: the ids, positions and slot in
    one, the window's bias; the graph; the hidden state's copy: 4) against an eager pass's (20 to 23 a layer
    and the embedding, rotary tables and final norm): the pass's cost on the host no longer grows with the layers (the lm_head, read after the
    pass, is the same either way)."""
    launches = {}
    with virtual_cuda() as mode:
        verify = torch_backend.verify_packed

        def counted(*args, **kwargs):
            with mode.counting() as ops:
                out = verify(*args, **kwargs)
            launches.setdefault(kwargs.get("label", args[0][0].graphs is not None), []).append(dict(ops))
            return out

        monkeypatch.setattr(torch_backend, "verify_packed", counted)
        eager = torch_backend.TorchSession(tiny_folder, "float32", device="cuda", kernels="torch")
        graphs, _ = _graph_session(tiny_folder, monkeypatch, mode)
        prompt = graphs.encode("count: 1 2 3 1 2 3")
        assert graphs.generate(prompt, NEW_TOKENS).token_ids == eager.generate(prompt, NEW_TOKENS).token_ids
    stepped = launches[True]
    assert len(stepped) == NEW_TOKENS - 1 and all(ops.get("graph replay") == 1 for ops in stepped)
    recorded = sorted(stepped, key=lambda ops: sum(ops.values()))[-3:]  # a recording runs the step's kernels too
    replayed = [ops for ops in stepped if ops not in recorded]
    host = max(sum(ops.values()) for ops in replayed)
    eager_step = min(sum(ops.values()) for ops in launches[False])
    print("host launches of a replayed step", host, replayed[0], "of an eager step", eager_step)
    assert host <= 4
    assert eager_step >= 20 * graphs.model.cfg.num_hidden_layers


def test_a_step_that_reads_the_cache_length_on_the_host_replays_stale(tiny_folder, monkeypatch):
    """The tape catches what a graph would freeze: with the key and value written at the cache's host
    length (the eager write) instead of the device slot, the replays overwrite the captured step's slot
    and the tokens leave plain's."""
    from mtpctl.model.kv_cache import PassSlots

    with virtual_cuda() as mode:
        eager = torch_backend.TorchSession(tiny_folder, "float32", device="cuda", kernels="torch")
        graphs, _ = _graph_session(tiny_folder, monkeypatch, mode)
        prompt = graphs.encode("count: 1 2 3 1 2 3")
        want = eager.generate(prompt, NEW_TOKENS).token_ids
        write = PassSlots.write

        def host_length_write(self, layer, k_new, v_new):
            self.at = None
            return write(self, layer, k_new, v_new)

        monkeypatch.setattr(PassSlots, "write", host_length_write)
        got = graphs.generate(prompt, NEW_TOKENS).token_ids
    assert got != want


def test_graphs_outlive_the_rotary_tables_another_cache_grows(tmp_path, monkeypatch):
    """Another engine with a longer cache grows the model's rotary tables mid-generation (reserve_rope
    replaces them); the recorded graphs read the old tables' memory, so they keep them alive (the tape
    holds what it read weakly, as a graph does, and a replay of a freed tensor raises) and the tokens stay
    the eager steps'."""
    from helpers import write_tiny_checkpoint
    from mtpctl.decode.tree import DraftTree

    folder = write_tiny_checkpoint(tmp_path / "long", max_position_embeddings=8192)
    tokens = {}
    with virtual_cuda() as mode:
        eager = torch_backend.TorchSession(folder, "float32", device="cuda", kernels="torch")
        graphs, _ = _graph_session(folder, monkeypatch, mode)
        for name, session in (("eager", eager), ("graphs", graphs)):
            engine, before = session.new_engine(300), session.model.rope_cos
            out, tokens[name] = engine.prefill(list(range(40, 60))), []
            for i in range(NEW_TOKENS):
                if i == 5:
                    session.new_engine(5000)  # the tables grow from 4096 positions to 8192
                tokens[name].append(int(out[0].argmax()))
                out = engine.verify(DraftTree(tokens[name][-1]))
                engine.commit([0])
            assert session.model.rope_cos is not before and session.model.rope_positions == 8192
    assert tokens["graphs"] == tokens["eager"]


def test_speculation_beside_replayed_steps_equals_plain(tiny_folder, monkeypatch):
    """ngram and lookahead with graphs on: their one-token passes replayed, their verify passes eager,
    each request gives plain greedy's tokens."""
    from mtpctl.drafters.build import DraftOptions, build, parse

    with virtual_cuda() as mode:
        eager = torch_backend.TorchSession(tiny_folder, "bfloat16", device="cuda", kernels="torch")
        graphs, _ = _graph_session(tiny_folder, monkeypatch, mode, "bfloat16")
        prompts = [graphs.encode(text) for text in ("count: 1 2 3 1 2 3 1 2 3", "abcabcabc abc")]
        want = [eager.generate(p, NEW_TOKENS).token_ids for p in prompts]
        for spec in ("ngram", "lookahead"):
            drafter = build(graphs, parse(spec), DraftOptions())
            assert [graphs.generate(p, NEW_TOKENS, drafter=drafter).token_ids for p in prompts] == want, spec
    assert not [e for e in mode.events if e.kind == "mixup"]


def test_cuda_graphs_refused_off_a_gpu(tiny_folder, capsys):
    """On the CPU: one clear error naming the flag (exit code 2); --json says whether graphs ran."""
    import json

    from helpers import cli

    with pytest.raises(UnsupportedModel, match="CUDA graphs replay decode steps on a CUDA device, not cpu/torch") as err:
        torch_backend.TorchSession(tiny_folder, "float32", device="cpu", kernels="torch", cuda_graphs=True)
    assert err.value.option == "cuda_graphs"
    code, out, err_text = cli(capsys, "generate", "-m", tiny_folder, "--kernels", "torch", "--cuda-graphs",
                              "--max-new-tokens", 4, "--no-chat", "abc")
    assert code == 2 and out == "" and err_text.count("\n") == 1 and "(--cuda-graphs)" in err_text, err_text
    code, out, _ = cli(capsys, "generate", "-m", tiny_folder, "--max-new-tokens", 4, "--no-chat", "--json", "abc")
    assert code == 0 and json.loads(out)["cuda_graphs"] is False


def test_cuda_graphs_refused_for_a_moe_body_on_a_virtual_gpu(tiny_folder, tmp_path):
    """A body whose passes are not held to fixed blocks (MoE: routing decides its rows' experts on the
    host) is refused at load, not decoded eagerly behind the user's back."""
    from mtpctl.model.synthetic import write_synthetic_checkpoint

    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
              "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
              "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "decoder_sparse_step": 1, "norm_topk_prob": True}
    folder = write_synthetic_checkpoint(tmp_path / "moe", config, tokenizer_from=tiny_folder)
    with virtual_cuda():
        with pytest.raises(UnsupportedModel, match="dense body; qwen3_moe's .* decodes eagerly") as err:
            torch_backend.TorchSession(folder, "float32", device="cuda", kernels="torch", cuda_graphs=True)
    assert err.value.option == "cuda_graphs"
