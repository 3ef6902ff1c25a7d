"""Runs greedy generations in vLLM's offline API, inside vLLM's own virtualenv (``make vllm-env``
creates ``.venv-vllm``; vLLM pins another transformers than mtpctl, so the two never share a process).

It imports nothing of mtpctl (mtpctl is not installed there): :mod:`mtpctl.bench.vllm_peer` runs it as
``.venv-vllm/bin/python vllm_worker.py`` with one JSON request on stdin and reads one JSON object from
stdout; vLLM's own logs go to stderr.

Request: ``model`` (a checkpoint folder), ``prompts`` (token id lists), ``max_new_tokens``,
``speculative_config`` (vLLM's, or null for plain decoding), ``threads``, ``dtype``, ``max_model_len``,
``weights_track`` (false turns off vLLM's check that every checkpoint tensor was loaded: its Medusa
loader loads ``token_map`` without reporting it), ``in_process`` (true: vLLM's engine core and its model
worker run in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which its CPU platform allows only
then; it starts in about half the time, for tests; by default each is a process of its own).

With ``max_num_seqs`` B the prompts after the first (a warm-up, run alone) run together, vLLM
scheduling up to B at once (continuous batching): each result's ``total_ms`` is then the whole
batch's wall time, also given as ``wall_ms``.

Reply: ``load_s`` (engine start), ``results`` (per prompt: ``token_ids`` and ``total_ms``, the
prompts run one at a time unless ``max_num_seqs``), ``wall_ms`` (with ``max_num_seqs``), ``spec`` (vLLM's speculation counters over all prompts: ``drafts``,
``draft_tokens``, ``accepted_tokens``, ``accepted_per_pos``; null without speculation), ``version``.
"""

import json
import os
import sys
import time

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # this folder holds mtpctl's modules, whose names must not hide vLLM's own

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters, summed over their label sets."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POSITION:
            values = [int(v) for v in metric.values]
            known = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(values, known + [0] * (len(values) - len(known)))]
    return out


def main() -> int:
    request = json.load(sys.stdin)
    reply = os.fdopen(os.dup(1), "w")  # the reply alone goes to stdout: whatever vLLM prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    threads = int(request.get("threads") or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if request.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(threads)
    extra = {} if request.get("weights_track", True) else {"model_loader_extra_config": {"enable_weights_track": False}}
    started = time.perf_counter()
    if request.get("max_num_seqs"):
        extra["max_num_seqs"] = int(request["max_num_seqs"])
    llm = LLM(model=request["model"], dtype=request.get("dtype") or "float32", enforce_eager=True, seed=0,
              max_model_len=int(request.get("max_model_len") or 2048), disable_log_stats=False,
              speculative_config=request.get("speculative_config"), **extra)
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=int(request["max_new_tokens"]))
    speculating = request.get("speculative_config") is not None
    before = spec_counters(llm) if speculating else None
    results, wall_ms = [], None
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in request["prompts"]]
    if request.get("max_num_seqs"):
        first = llm.generate(prompts[:1], params, use_tqdm=False)[0]
        start = time.perf_counter()
        outs = llm.generate(prompts[1:], params, use_tqdm=False)
        wall_ms = (time.perf_counter() - start) * 1e3
        results = [{"token_ids": list(o.outputs[0].token_ids), "total_ms": wall_ms} for o in [first] + list(outs)]
    for prompt in (prompts if wall_ms is None else []):
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        results.append({"token_ids": list(out.outputs[0].token_ids),
                        "total_ms": (time.perf_counter() - start) * 1e3})
    spec = None
    if speculating:
        after = spec_counters(llm)
        spec = {k: after[k] - before[k] for k in COUNTERS.values()}
        spec["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"],
                                                          before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"]))]
    json.dump({"load_s": load_s, "results": results, "wall_ms": wall_ms, "spec": spec, "version": __version__}, reply)
    reply.write("\n")
    reply.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
