"""The process a peer of the benchmark runs in (:mod:`mtpctl.bench.peer_process` starts it as
``python -m mtpctl.bench.peer_worker``).

Reads JSON lines on stdin: first the request, ``{"peer": "transformers" | "llama.cpp", "threads": N,
"max_new_tokens": N, "eos_ids": [...], ...}`` with the peer's own settings (:func:`build`: ``folder``,
``prompt_lookup_num_tokens``, ``use_mtp`` and ``assistant`` for transformers, ``gguf`` for llama.cpp), answered
``{"ready": true, "build": {...}}`` (:func:`describe`); then ``{"prompt_ids": [...]}`` per run, answered ``{"token_ids": [...],
"total_ms": ...}``. An error the peer raises is answered ``{"error": "..."}`` and ends the worker;
a crash ends it without an answer (the parent reads the signal). The answers alone go to stdout:
whatever the peer's libraries print goes to stderr.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path


def build(request: dict):
    """The runner ``prompt ids -> GenerationResult`` of the requested peer (:mod:`mtpctl.bench.peers`)."""
    import torch

    from mtpctl.bench.peers import llamacpp_runner, transformers_runner

    threads = int(request.get("threads") or 1)
    torch.set_num_threads(threads)
    eos, new = request["eos_ids"], int(request["max_new_tokens"])
    if request["peer"] == "transformers":
        assistant = Path(request["assistant"]) if request.get("assistant") else None
        return transformers_runner(Path(request["folder"]), eos, new, int(request.get("prompt_lookup_num_tokens", 0)),
                                   assistant, bool(request.get("use_mtp")))
    if request["peer"] == "llama.cpp":
        return llamacpp_runner(Path(request["gguf"]), eos, new, threads)
    raise ValueError(f"unknown peer {request['peer']!r}")


def describe(peer: str) -> dict:
    """Which build of the peer runs: its package's version and, for llama.cpp, ggml's system info
    (the CPU features it was compiled for, ``AMX_INT8 = 1`` where its AMX path is in)."""
    if peer == "llama.cpp":
        import llama_cpp

        return {"llama_cpp_python": llama_cpp.__version__,
                "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()}
    import transformers

    return {"transformers": transformers.__version__}


def serve(reply) -> None:
    """Answer the request, then each run, on ``reply`` (module docstring)."""
    request = json.loads(sys.stdin.readline())
    run = build(request)
    _answer(reply, {"ready": True, "build": describe(request["peer"])})
    for line in sys.stdin:
        if not line.strip():
            continue
        result = run(json.loads(line)["prompt_ids"])
        _answer(reply, {"token_ids": result.token_ids, "total_ms": result.stats.total_ms})


def _answer(reply, message: dict) -> None:
    reply.write(json.dumps(message) + "\n")
    reply.flush()


def main() -> int:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the peer's libraries print to stdout: send that to the log, keep stdout for answers
    sys.stdout = sys.stderr
    faulthandler.enable()  # a crash inside a peer's library leaves its Python stack in the log
    try:
        serve(reply)
    except Exception as err:  # reported to the parent, which marks the peer's row failed with it
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        _answer(reply, {"error": f"{type(err).__name__}: {str(err)[:300]}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
