"""Peers to compare mtpctl with, run on the same prompt token ids: HF transformers' ``generate``
(plain and prompt lookup) and llama.cpp (llama-cpp-python) on the GGUF file. ``mtpctl bench`` runs
each in its own process (:mod:`mtpctl.bench.peer_process`, which calls these in
:mod:`mtpctl.bench.peer_worker`), so a peer's crash costs its row alone. Each is a runner ``prompt ids -> GenerationResult`` for :func:`mtpctl.bench.harness.run_interleaved`;
their runs carry total time and new tokens only (TTFT, ITL and tau are not observable from outside)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from mtpctl.decode.loop import GenerationResult, GenerationStats


def transformers_runner(folder: Path, eos_ids: Sequence[int], max_new_tokens: int,
                        prompt_lookup_num_tokens: int = 0, assistant: Optional[Path] = None,
                        use_mtp: bool = False) -> Callable[[List[int]], GenerationResult]:
    """A peer to compare with: HF transformers' greedy ``generate`` (float32) on the same checkpoint,
    plain, with prompt lookup (``prompt_lookup_num_tokens``), drafting with the checkpoint's own MTP
    layers (``use_mtp``: its ``MTPCandidateGenerator``, for the families transformers reads them of), or
    assisted by the draft model in the checkpoint folder ``assistant`` (with both tokenizers:
    transformers' universal assisted generation, which also pairs models whose tokenizers differ)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eos = sorted(eos_ids)
    extra = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens} if prompt_lookup_num_tokens else {}
    if use_mtp:
        extra["use_mtp"] = True
    if assistant is not None:
        extra = {"assistant_model": AutoModelForCausalLM.from_pretrained(str(assistant), dtype=torch.float32).eval(),
                 "tokenizer": AutoTokenizer.from_pretrained(str(folder)),
                 "assistant_tokenizer": AutoTokenizer.from_pretrained(str(assistant))}

    def run(prompt_ids: List[int]) -> GenerationResult:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos[0], **extra)
        total_ms = (time.perf_counter() - start) * 1e3
        new = trim_at_eos(out[0, len(prompt_ids):].tolist(), eos)
        stats = GenerationStats(prompt_tokens=len(prompt_ids), new_tokens=len(new), ttft_ms=None, total_ms=total_ms)
        return GenerationResult(new, "", "eos" if new and new[-1] in eos else "length", stats)

    return run


def trim_at_eos(tokens: List[int], eos_ids: Sequence[int]) -> List[int]:
    """``tokens`` up to and including the first EOS (assisted generation may keep accepted tokens past it)."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i + 1]
    return tokens


def llamacpp_runner(gguf: Path, eos_ids: Sequence[int], max_new_tokens: int, threads: int,
                    context: int = 4096) -> Callable[[List[int]], GenerationResult]:
    """A peer to compare with: llama.cpp (through llama-cpp-python) decoding the GGUF file itself,
    greedy, from the same prompt token ids, on ``threads`` CPU threads. Its runs carry total time
    and new tokens only (prefill included, as in mtpctl's runs).

    Raises:
        ImportError: llama-cpp-python is not installed.
    """
    from llama_cpp import Llama


    llm = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)
    eos = set(eos_ids)

    def run(prompt_ids: List[int]) -> GenerationResult:
        llm.reset()
        new: List[int] = []
        start = time.perf_counter()
        for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            new.append(int(token))
            if token in eos or len(new) >= max_new_tokens:
                break
        total_ms = (time.perf_counter() - start) * 1e3
        stats = GenerationStats(prompt_tokens=len(prompt_ids), new_tokens=len(new), ttft_ms=None, total_ms=total_ms)
        return GenerationResult(new, "", "eos" if new and new[-1] in eos else "length", stats)

    return run
