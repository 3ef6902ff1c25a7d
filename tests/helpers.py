"""Builders shared by the tests: tiny random models (in memory and as checkpoint folders), the
decoding loop on them, drafters with known behaviour, exact sequence probabilities for the sampling
tests, and the lossless comparison used on real models."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import List, Sequence

import pytest
import torch

from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.loop import generate
from mtpctl.decode.sampling import SamplingParams, probs_from_logits
from mtpctl.decode.stopping import StopChecker
from mtpctl.decode.tree import DraftTree
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder
from mtpctl.model.linears import blocked_layout_available

#: float32 and bfloat16 as a test's ``dtype`` parameter, each skipped where oneDNN's blocked layout does
#: not run for it (bfloat16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: not on an AVX2-only CPU)
BLOCKED_DTYPES = [pytest.param(dtype, id=str(dtype).split(".")[-1], marks=pytest.mark.skipif(
    not blocked_layout_available(dtype), reason=f"oneDNN's blocked layout does not run for {dtype} here"))
    for dtype in (torch.float32, torch.bfloat16)]

#: the prompt of the tiny-model tests (token ids)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 5, 17]
GREEDY = SamplingParams()

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_config_dict(vocab: int = 259, max_pos: int = 128, **overrides) -> dict:
    """A Llama config small enough to run in milliseconds."""
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": max_pos,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
           "bos_token_id": 257, "eos_token_id": 258, "initializer_range": 0.3}
    cfg.update(overrides)
    return cfg


def random_state_dict(cfg: DecoderConfig, seed: int = 0, scale: float = 0.3) -> dict:
    """HF-named random tensors for ``cfg`` (norm weights near 1) so logits are well separated."""
    from mtpctl.model.decoder import expected_tensors

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_tensors(cfg).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = scale * torch.randn(shape, generator=g)
    return out


def random_decoder(seed: int = 0, dtype=torch.float32, blocked: bool = False, **overrides) -> Decoder:
    """A tiny in-memory decoder with random weights (``blocked``: linear weights in oneDNN's layout)."""
    cfg = DecoderConfig.from_dict(tiny_config_dict(**overrides))
    model = Decoder(cfg, dtype)
    model.load_hf_tensors(random_state_dict(cfg, seed), blocked=blocked)
    return model


def write_tiny_checkpoint(folder: Path, seed: int = 0, **overrides) -> Path:
    """A complete HF checkpoint folder: config.json, model.safetensors, byte-level BPE tokenizer with
    a chat template. Token ids: 0..255 bytes, 256 <|endoftext|>, 257 <|im_start|>, 258 <|im_end|> (EOS)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    cfg_dict = tiny_config_dict(**overrides)
    (folder / "config.json").write_text(json.dumps(cfg_dict))
    cfg = DecoderConfig.from_dict(cfg_dict)
    save_file({k: v.contiguous() for k, v in random_state_dict(cfg, seed).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab = {ch: i for i, ch in enumerate(sorted(vocab, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return folder


#: tiny Mixture-of-Experts checkpoints built with transformers' own classes (tests/test_moe_families.py,
#: tests/test_moe_downstream.py): the shapes every model_type shares, and each model_type's MoE keys
#: (Qwen3-MoE: layer 1 dense, through mlp_only_layers)
MOE_COMMON = dict(vocab_size=259, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=257, eos_token_id=258)
MOE_EXTRA = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                               norm_topk_prob=True, mlp_only_layers=[1]),
             "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)}


def random_reference_model(model_type: str, **config):
    """transformers' tiny random model of ``model_type`` with these config keys (float32, eval), seeded:
    matrices drawn N(0, 0.2), larger than the default init, so logits and router choices stand well
    apart, and any ``e_score_correction_bias`` N(0, 0.1), so expert selection reads it."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **config),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def moe_reference_model(model_type: str, **overrides):
    """transformers' tiny random MoE model of ``model_type`` (:func:`random_reference_model`);
    ``overrides`` change config keys."""
    return random_reference_model(model_type, **{**MOE_COMMON, **MOE_EXTRA[model_type], **overrides})


def write_moe_checkpoints(root: Path, model_type: str, reference=None, tokenizer: Path = None) -> dict:
    """``model_type``'s tiny MoE checkpoint in both layouts under ``root``, each with the tiny
    byte-level tokenizer (:func:`write_tiny_checkpoint`'s): ``{"per_expert": folder}`` (what
    ``save_pretrained`` writes: one tensor per expert) and ``{"stacked": folder}`` (transformers 5's
    ``state_dict``: experts stacked; a tied lm_head left out)."""
    import shutil

    from safetensors.torch import save_file

    reference = reference if reference is not None else moe_reference_model(model_type)
    tokenizer = tokenizer if tokenizer is not None else write_tiny_checkpoint(root / "tokenizer")
    per_expert, stacked = root / model_type / "per_expert", root / model_type / "stacked"
    reference.save_pretrained(str(per_expert))
    stacked.mkdir(parents=True)
    shutil.copy(per_expert / "config.json", stacked / "config.json")
    state = reference.state_dict()
    if reference.config.tie_word_embeddings:  # the lm_head is the embedding: not written twice
        del state["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(stacked / "model.safetensors"),
              metadata={"format": "pt"})
    for folder in (per_expert, stacked):
        copy_tokenizer_files(tokenizer, folder)
    return {"per_expert": per_expert, "stacked": stacked}


def greedy_reference(model: Decoder, prompt: Sequence[int], n: int) -> List[int]:
    """Plain greedy decoding, one token per forward pass (the definition speculation must match)."""
    engine = TorchEngine(model, len(prompt) + n + 1)
    token = int(engine.prefill(prompt).logits[-1].argmax())
    out = [token]
    while len(out) < n:
        logits = engine.verify(DraftTree(token)).logits[-1]
        engine.commit([0])
        token = int(logits.argmax())
        out.append(token)
    return out


def decode(ids):
    """Each id as one letter: text positions equal token positions."""
    return "".join(chr(ord("a") + t % 26) for t in ids)


def run(model, drafter=None, max_new=40, eos=(), stops=(), sampling=GREEDY, prompt=PROMPT):
    """The decoding loop on ``model`` with ``drafter`` (its budget sizes the cache)."""
    budget = drafter.budget if drafter is not None else 0
    engine = TorchEngine(model, len(prompt) + max_new + budget + 1)
    return generate(engine, prompt, StopChecker(eos, stops, max_new, decode), sampling, drafter)


def exact_sequence_probs(model, prompt, n, params):
    """P(first n generated tokens) under plain sampling, by enumeration (small vocab)."""
    vocab = model.cfg.vocab_size
    probs = {}
    for seq in itertools.product(range(vocab), repeat=n):
        logits = TorchEngine(model, len(prompt) + n).verify(DraftTree.chain(list(prompt) + list(seq))).logits
        rows = probs_from_logits(logits[len(prompt) - 1:-1], params)
        probs[seq] = float(torch.prod(rows[torch.arange(n), torch.tensor(seq)]))
    return probs


class ScriptedDrafter:
    """Proposes a known continuation (e.g. plain greedy output) of up to ``budget`` tokens, with every
    ``corrupt_every``-th proposal changed, so tests exercise both accepted and rejected draft tokens."""

    def __init__(self, prompt_len: int, continuation: Sequence[int], vocab: int, corrupt_every: int = 0,
                 budget: int = 6):
        self.prompt_len, self.continuation, self.vocab = prompt_len, list(continuation), vocab
        self.corrupt_every, self.calls, self.budget = corrupt_every, 0, budget

    def propose(self, context: Sequence[int], max_tokens: int, last=None) -> DraftTree:
        done = len(context) - self.prompt_len
        tokens = self.continuation[done: done + max_tokens]
        self.calls += 1
        if self.corrupt_every and tokens and self.calls % self.corrupt_every == 0:
            i = self.calls % len(tokens)
            tokens[i] = (tokens[i] + 1) % self.vocab
        return DraftTree.chain([context[-1]] + tokens)


def top2_gap(logits: torch.Tensor) -> float:
    """Difference between the two largest logits of ``logits [vocab]``."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token, or -1 when one sequence is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1


def gguf_grid_decoder(seed: int = 0) -> Decoder:
    """A tiny decoder whose linear weights lie on GGUF grids (Q4_1 layers, Q8_0 embeddings), as a
    dequantized GGUF import does, loaded with ``packed=True`` (bfloat16, int4 kernel)."""
    cfg = DecoderConfig.from_dict(tiny_config_dict(vocab=272))
    model = Decoder(cfg, torch.bfloat16)
    model.load_hf_tensors(gguf_grid_tensors(cfg, seed), packed=True)
    return model


def write_gguf_grid_checkpoint(folder: Path, seed: int = 0) -> Path:
    """:func:`write_tiny_checkpoint` with the weights of :func:`gguf_grid_decoder` (loadable with
    ``--weights int4``)."""
    from safetensors.torch import save_file

    write_tiny_checkpoint(folder, seed, vocab=272)
    cfg = DecoderConfig.from_dict(json.loads((folder / "config.json").read_text()))
    save_file({k: v.contiguous() for k, v in gguf_grid_tensors(cfg, seed).items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def gguf_grid_tensors(cfg: DecoderConfig, seed: int = 0) -> dict:
    """Random checkpoint tensors whose linear weights lie on GGUF grids (see :func:`gguf_grid_decoder`)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, value in random_state_dict(cfg, seed).items():
        if value.dim() == 2 and value.shape[1] % 32 == 0:
            n, k = value.shape
            if "embed" in name:
                q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
                q[..., 0] = 127
                value = (q * torch.rand(n, k // 32, 1, generator=g).half().float() * 0.01).reshape(n, k)
            else:
                q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
                q[..., 0], q[..., 1] = 0, 15
                d = torch.rand(n, k // 32, 1, generator=g).half().float() * 0.08
                value = (q * d - 7.5 * d).reshape(n, k)
        tensors[name] = value
    return tensors


def plain_decode_logits(model: Decoder, prompt: Sequence[int], tokens: Sequence[int], capacity: int,
                        native=None) -> torch.Tensor:
    """Logits ``[vocab]`` after ``prompt`` and then ``tokens`` fed one token per pass (plain decoding)."""
    engine = TorchEngine(model, capacity, native=native)
    engine.prefill(list(prompt))
    for t in tokens:
        row = engine.verify(DraftTree(t))[0]
        engine.commit([0])
    return row


def tree_positions(parents: Sequence[int]):
    """``(depth [N], ancestor mask [N, N])`` of the tree given by ``parents`` (-1 the root)."""
    tree = DraftTree.from_parents(list(range(len(parents))), parents)
    return tree.depth_tensor(), tree.ancestor_mask()


def random_heads(model, num_heads=3, seed=0, draft_vocab=0):
    """Medusa heads with random weights for ``model`` (float32; ``draft_vocab``: every second id)."""
    from mtpctl.drafters.heads.config import HeadsConfig
    from mtpctl.drafters.heads.medusa import MedusaHeads

    cfg = HeadsConfig("medusa", num_heads, 1, False, model.cfg.hidden_size, model.cfg.vocab_size, draft_vocab)
    token_map = torch.arange(0, 2 * draft_vocab, 2) if draft_vocab else None
    heads = MedusaHeads(cfg, torch.float32, model.dense_lm_head().float(), token_map)
    g = torch.Generator().manual_seed(seed)
    for p in heads.parameters():
        p.data = 0.3 * torch.randn(p.shape, generator=g)
    return heads.requires_grad_(False)


def perturbed(module: torch.nn.Module, seed: int, scale: float = 0.3) -> torch.nn.Module:
    """``module`` with seeded N(0, scale) noise added to every parameter, frozen (random heads whose
    norms are not all ones and whose drafts differ)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return module.requires_grad_(False)


def generate_json(main, capsys, args: Sequence[str]) -> dict:
    """``mtpctl generate ARGS --json`` through the CLI's ``main``: its JSON reply (exit code 0 asserted)."""
    capsys.readouterr()
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)

def cli(capsys, *args):
    """``mtpctl ARGS`` in this process: (exit code, stdout, stderr)."""
    from mtpctl.cli.main import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def generate_plain_and(capsys, folder, *spec_args):
    """``generate --json`` on ``folder`` plain and with ``spec_args``: (plain result, speculative
    result, the speculative run's stderr); fails unless both exit 0."""
    args = ["generate", "-m", folder, "--json", "--max-new-tokens", 24, "--no-chat", "abcabcabc"]
    code, plain, err = cli(capsys, *args)
    assert code == 0, err
    code, spec, err = cli(capsys, *args, *spec_args)
    assert code == 0, err
    return json.loads(plain), json.loads(spec), err


def assert_one_line_exit_2(code, out, err, fragment):
    """A bad input's CLI outcome: exit 2, nothing on stdout, one ``mtpctl: error:`` line holding
    ``fragment``, no traceback."""
    assert code == 2 and out == "" and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtpctl: error:") and fragment in lines[0], err


def tiny_hydra_folder(tiny_folder: Path, out: Path) -> Path:
    """A head folder of 2 random token-conditioned Hydra heads for the tiny checkpoint ``tiny_folder``
    (tree [[0], [1], [0, 0]]), written to ``out``."""
    from mtpctl.drafters.heads.config import HeadsConfig
    from mtpctl.drafters.heads.folder import save_heads
    from mtpctl.drafters.heads.medusa import MedusaHeads
    from mtpctl.model.weights import weights_hash

    cfg = json.loads((tiny_folder / "config.json").read_text())
    heads = MedusaHeads(HeadsConfig("hydra", 2, 1, False, cfg["hidden_size"], cfg["vocab_size"], token_conditioned=True,
                                    target_hash=weights_hash(tiny_folder), tree=[[0], [1], [0, 0]]))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    out.mkdir()
    save_heads(heads, out)
    return out


# ---- draft trees, random heads and constants shared by several test modules

#: the draft-tree shapes the head tests decode with (paths of child ranks)
TREES = {
    "chain": [[0], [0, 0], [0, 0, 0]],
    "wide": [[0], [1], [2], [3]],
    "mixed": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    "deep-second": [[0], [1], [1, 0], [1, 0, 0], [1, 0, 0, 0]],
}

#: the static tree of the export tests' random head folders (:func:`make_heads`, :func:`truncated_heads`)
TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def make_heads(folder: Path, target: Path, num_heads: int = 3, seed: int = 0, own_lm_head: bool = False,
               hidden: int = 64, vocab: int = 259) -> Path:
    """A head folder with random weights for the checkpoint in ``target``."""
    from mtpctl.drafters.heads.config import HeadsConfig
    from mtpctl.drafters.heads.folder import save_heads
    from mtpctl.drafters.heads.medusa import MedusaHeads
    from mtpctl.model.weights import weights_hash

    cfg = HeadsConfig(kind="medusa", num_heads=num_heads, head_layers=1, own_lm_head=own_lm_head,
                      hidden_size=hidden, vocab_size=vocab, target=str(target), target_hash=weights_hash(target),
                      tree=TREE, topk_accuracy=[[0.5, 0.2]] * num_heads)
    g = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(cfg, target_lm_head=torch.zeros(vocab, hidden) if own_lm_head else None)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    folder.mkdir(parents=True)
    save_heads(heads, folder)
    return folder


def truncated_heads(folder, target, model, own: bool):
    """Medusa heads (3 heads of 2 layers, the tiny checkpoint's hidden size 64 and vocabulary 259) with a
    draft vocabulary of 100 tokens (token_map), own lm_heads or the target's rows."""
    from mtpctl.drafters.heads.config import HeadsConfig
    from mtpctl.drafters.heads.folder import save_heads
    from mtpctl.drafters.heads.medusa import MedusaHeads
    from mtpctl.model.weights import weights_hash

    num_heads, hidden, vocab = 3, 64, 259
    cfg = HeadsConfig(kind="medusa", num_heads=num_heads, head_layers=2, own_lm_head=own, hidden_size=hidden,
                      vocab_size=vocab, draft_vocab_size=100, target=str(target), target_hash=weights_hash(target),
                      tree=TREE)
    g = torch.Generator().manual_seed(7)
    heads = MedusaHeads(cfg, target_lm_head=model.dense_lm_head(), token_map=torch.randperm(vocab, generator=g)[:100])
    with torch.no_grad():
        for name, p in heads.named_parameters():
            p.copy_(p + 0.1 * torch.randn(p.shape, generator=g))
    folder.mkdir()
    save_heads(heads, folder)
    return folder


def random_eagle(model, depth=4, seed=0, draft_vocab=0):
    """An EAGLE draft layer (kind ``eagle``) with random weights for ``model`` (float32; ``draft_vocab``:
    every second id)."""
    from mtpctl.drafters.heads.config import HeadsConfig
    from mtpctl.drafters.heads.eagle import EagleHead, layer_config_for

    cfg = HeadsConfig("eagle", depth, 0, False, model.cfg.hidden_size, model.cfg.vocab_size, draft_vocab,
                      layer=layer_config_for(model.cfg))
    token_map = torch.arange(0, 2 * draft_vocab, 2) if draft_vocab else None
    torch.manual_seed(seed)  # the layer's own initialisation draws from the global generator
    return perturbed(EagleHead(cfg, torch.float32, model.dense_lm_head().float(), token_map), seed)


def trace_as_over_2gb(monkeypatch) -> list:
    """Make every export's trace what torch writes for a graph over 2 GB: the graph without its large
    tensors, each initializer and Constant of 4 KiB or more in a file of its own beside it, smaller ones
    inline (onnx's per-tensor layout, on the tiny model). Returns a list that gets the trace folder's
    file names of each export."""
    import onnx

    from mtpctl.export import onnx as onnx_export

    real, seen = onnx_export.trace_graph, []

    def split(wrapper, raw):
        real(wrapper, raw)
        onnx.save_model(onnx.load(str(raw)), str(raw), save_as_external_data=True, all_tensors_to_one_file=False,
                        size_threshold=4096, convert_attribute=True)
        seen.append(sorted(p.name for p in raw.parent.iterdir()))

    monkeypatch.setattr(onnx_export, "trace_graph", split)
    return seen


#: the tiny random Gemma 3 config of the Gemma 3 tests: a sliding window (4) shorter than the sequences,
#: local and global layers with their own rope
GEMMA3_VOCAB = 97
GEMMA3_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
GEMMA3_TINY = dict(vocab_size=GEMMA3_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                   rms_norm_eps=1e-6, sliding_window=4, query_pre_attn_scalar=24, layer_types=GEMMA3_LAYER_TYPES,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})


# ---- the real models (SmolLM2-135M-Instruct)

#: a top-2 logit gap under which a greedy flip between plain and speculative decoding is fp32 noise
NEAR_TIE = 1e-3

#: the prompts of the real SmolLM2 lossless tests
SMOLLM2_PROMPTS = [
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List the planets of the solar system in order, one per line, with one fact each.",
    "Summarize in two sentences: Speculative decoding lets a cheap drafter propose several tokens "
    "that the large model verifies in a single forward pass, keeping only those it agrees with.",
]


def assert_lossless(session, prompt_ids, plain, spec):
    """``spec`` equals ``plain``, or first differs at a near-tie of plain decoding's logits."""
    import warnings

    i = first_divergence(plain, spec)
    if i < 0:
        assert len(plain) == len(spec) or plain[-1] in session.codec.eos_ids or spec[-1] in session.codec.eos_ids
        return
    engine = TorchEngine(session.model, len(prompt_ids) + i + 1)
    gap = top2_gap(engine.prefill(list(prompt_ids) + plain[:i]).logits[-1])
    assert gap < NEAR_TIE, f"divergence at token {i} with top-2 logit gap {gap:.2e}: a bug, not a near-tie"
    warnings.warn(f"near-tie flip at token {i} (top-2 gap {gap:.2e})")


#: token-id prompts of the tiny family checkpoints' parity tests (the tiny tokenizer's ids; 258 is EOS)
FAMILY_PROMPTS = ([5, 77, 200, 31, 9], [100, 101, 102, 100, 101, 102, 100, 101, 102],
                  [44] * 3 + [12, 250, 7, 61, 3, 90, 18])


def assert_equals_transformers(reference, model: Decoder, folder: Path, prompts=FAMILY_PROMPTS, new: int = 32):
    """mtpctl against transformers' ``reference`` (float32): prefill logits within 1e-4 at every position
    of each prompt, and ``new`` greedy tokens of ``folder`` loaded by :func:`mtpctl.load` equal to
    transformers' ``generate`` (up to EOS)."""
    import mtpctl

    for prompt in prompts:
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        ours = TorchEngine(model, len(prompt) + 1).verify(DraftTree.chain(prompt)).logits
        assert (ours - expected).abs().max() < 1e-4
    llm = mtpctl.load(str(folder), speculate="none", dtype="float32", threads=1)
    for prompt in prompts:
        with torch.no_grad():
            hf = reference.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        ours = llm.pipeline.generate(list(prompt), new).token_ids
        assert ours == hf[:len(ours)] and (len(ours) == new or ours[-1] == 258)


def assert_speculation_equals_plain(folder: Path, dtype: str, prompts=FAMILY_PROMPTS, new: int = 32):
    """Greedy prompt lookup on ``folder`` (each prompt alone, and all in one batch) and a scripted
    drafter (exact, and every third proposal corrupted) give plain greedy decoding's tokens."""
    import mtpctl
    from mtpctl.decode.session import GenerationRequest

    plain = mtpctl.load(str(folder), speculate="none", dtype=dtype, threads=1)
    # ngram_min 1: random tiny models rarely repeat two tokens in a row, so the default match length of
    # 2 would draft little; one-token matches make prompt lookup draft (and miss) on most steps
    ngram = mtpctl.load(str(folder), speculate="ngram", dtype=dtype, speculate_policy="always", threads=1,
                        ngram_min=1)
    expected = [plain.pipeline.generate(list(p), new).token_ids for p in prompts]
    looked_up = [ngram.pipeline.generate(list(p), new) for p in prompts]
    assert [r.token_ids for r in looked_up] == expected
    assert sum(r.stats.draft_tokens for r in looked_up) > 0  # it did draft
    batch = ngram.generate_batch([GenerationRequest(list(p), new) for p in prompts], max_batch=len(prompts))
    assert [r.token_ids for r in batch] == expected
    model = plain.session.model
    alone = run(model, max_new=new, prompt=prompts[1])
    for corrupt in (0, 3):
        drafter = ScriptedDrafter(len(prompts[1]), alone.token_ids, model.cfg.vocab_size, corrupt_every=corrupt)
        assert run(model, drafter, max_new=new, prompt=prompts[1]).token_ids == alone.token_ids


def write_multimodal_checkpoint(reference, config_cls, model_cls, folder: Path, text_folder: Path) -> dict:
    """``reference``'s text body (a transformers causal LM) inside transformers' multimodal ``model_cls``
    (a tiny vision tower; ``config_cls`` with ``text_config``), saved into ``folder`` with an ``mtp.*``
    tensor as released checkpoints carry and ``text_folder``'s tokenizer files. Returns its tensors as
    transformers wrote them (before the ``mtp.*`` one)."""
    from safetensors.torch import load_file, save_file

    config = config_cls(text_config=reference.config.to_dict(), tie_word_embeddings=False,
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                           out_hidden_size=64))
    model = model_cls(config).eval()
    model.model.language_model.load_state_dict(reference.model.state_dict())
    model.lm_head.load_state_dict(reference.lm_head.state_dict())
    model.save_pretrained(str(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "mtp.fc.weight": torch.ones(64, 128)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    copy_tokenizer_files(text_folder, folder)
    return tensors


def copy_tokenizer_files(tokenizer: Path, folder: Path) -> Path:
    """Copy the tokenizer files of checkpoint folder ``tokenizer`` (all but its config.json and weights)
    into checkpoint folder ``folder``; returns ``folder``."""
    import shutil

    for f in Path(tokenizer).iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, Path(folder) / f.name)
    return Path(folder)


def randomize_hybrid_weights(model, scale: float):
    """A transformers Qwen3.5 / Qwen3-Next model's parameters drawn in place, for a tiny hybrid body
    whose layers all matter: matrices N(0, 1/sqrt(fan-in)) * ``scale``, biases N(0, 0.5), RMSNorm
    offsets N(0, 0.3) (the gated norm's weight around 1, as it is used), decays ``exp(g)`` spread over
    (0, 1). Returns ``model``."""
    import math

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())
            elif name.endswith("bias"):  # dt_bias and attention biases
                p.copy_(0.5 * torch.randn_like(p))
            elif p.dim() == 1:  # RMSNorm offsets (1 + w), the gated norm's weight as it is
                p.copy_((1.0 if name.endswith("linear_attn.norm.weight") else 0.0) + 0.3 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return model


def assert_distilled_features_match(model: Decoder) -> None:
    """The features add-heads trains on, kept from batched self-distillation of ``model`` (padded rows of
    different lengths), equal one teacher-forced pass over each finished sequence (hidden states and
    EAGLE-3 layer streams within bfloat16 storage, argmax tokens exactly) and the decoding engine's
    verify pass over it (argmax tokens, hidden states)."""
    from mtpctl.train.distill import TrainSequence, batch_greedy
    from mtpctl.train.features import compute_features
    from mtpctl.train.settings import TrainSettings

    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9]]
    got = batch_greedy(model, prompts, 6, eos_ids=set(), batch_size=3, keep_features=True, aux_layers=(0, 2))
    eagle3 = TrainSettings(kind="eagle3", aux_layers=[0, 2])
    for prompt, d in zip(prompts, got):
        ids = prompt + d.response
        ref = compute_features(model, [TrainSequence(ids, len(prompt))], eagle3)
        torch.testing.assert_close(d.hidden.float(), ref.hidden.float(), atol=0.02, rtol=0.02)  # bf16 storage
        torch.testing.assert_close(d.aux.float(), ref.aux.float(), atol=0.05, rtol=0.02)
        assert d.pred.tolist() == ref.pred.tolist()
        out = TorchEngine(model, len(ids) + 1).verify(DraftTree.chain(ids))
        assert out.logits.argmax(-1).tolist() == ref.pred.tolist()
        torch.testing.assert_close(out.hidden_states.float(), ref.hidden.float(), atol=0.02, rtol=0.02)


def accepted_by_position(results, chain: int) -> list:
    """Accepted draft tokens at each position of a ``chain``-token draft, over every step of ``results``
    (what vLLM's ``accepted_per_pos`` counts)."""
    counts = [0] * chain
    for r in results:
        for committed in r.stats.accepted_per_step:
            for j in range(min(committed - 1, chain)):
                counts[j] += 1
    return counts
