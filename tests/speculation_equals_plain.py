"""Greedy speculation against plain greedy decoding on one model, dtype and weights, in this process's
CPU path: run as a script (tests/test_cpu_matrix.py runs it with a matmul path forced), it prints one
JSON object: the path each product took, ``greedy_exactness``, and for prompt lookup (alone and in a
batch of the prompts) whether every request's tokens equal plain decoding's.

    python tests/speculation_equals_plain.py MODEL_FOLDER DTYPE WEIGHTS [NEW_TOKENS]
"""

from __future__ import annotations

import json
import sys

PROMPTS = ("Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
           "List the planets of the solar system in order, one per line.",
           "Copy this list, then add one more item in the same style: 1. apples (red), 2. bananas (yellow).")


def main(folder: str, dtype: str, weights: str, new_tokens: int) -> dict:
    import mtpctl
    from mtpctl.decode.session import GenerationRequest

    def load(speculate: str):
        return mtpctl.load(folder, speculate=speculate, dtype=dtype, weights=weights, speculate_policy="always",
                           threads=1)

    plain, ngram = load("none"), load("ngram")
    ids = [plain.encode(p) for p in PROMPTS]
    expected = [plain.pipeline.generate(i, new_tokens).token_ids for i in ids]
    alone = [ngram.pipeline.generate(i, new_tokens) for i in ids]
    batch = ngram.generate_batch([GenerationRequest(i, new_tokens) for i in ids], max_batch=len(ids))
    session = ngram.session
    return {"matmul_isa": session.matmul_isa, "matmul_paths": session.matmul_paths,
            "greedy_exactness": session.greedy_exactness, "attention": session.attention,
            "ngram_equal": [r.token_ids == e for r, e in zip(alone, expected)],
            "ngram_accepted": sum(r.stats.accepted_tokens for r in alone),
            "batch_equal": [r.token_ids == e for r, e in zip(batch, expected)]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 24)))
