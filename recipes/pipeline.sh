#!/usr/bin/env bash
# An example deployment pipeline to copy: train MTP heads from a recipe, export the fused
# draft/verify graph, then benchmark the exported graph and gate on its speedup and latency.
# Every step's exit code is passed on: 0 ok, 1 a gate failed, 2 bad input, 3 internal error.
#
#   recipes/pipeline.sh                                  # the default model and recipe
#   MIN_SPEEDUP=1.5 WORK=build/release recipes/pipeline.sh
#
# Settings (environment variables):
#   MTPCTL       the mtpctl command            (default: mtpctl on PATH, else .venv/bin/mtpctl)
#   RECIPE       add-heads recipe              (default: recipes/smollm2-135m-medusa.yaml)
#   MODEL        target model                  (default: the recipe's model)
#   WORK         output folder of the run      (default: build/pipeline; replaced on each run)
#   MIN_SPEEDUP  gate: heads' median speedup over plain decoding must reach it (default: 1.3)
#   MAX_P99_MS   gate: p99 inter-token latency of every method, ms              (default: 250)
#   BENCH_ARGS   extra mtpctl bench options    (default: --limit 2 --max-new-tokens 64)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MTPCTL="${MTPCTL:-$(command -v mtpctl || echo "$here/../.venv/bin/mtpctl")}"
RECIPE="${RECIPE:-$here/smollm2-135m-medusa.yaml}"
WORK="${WORK:-build/pipeline}"
MIN_SPEEDUP="${MIN_SPEEDUP:-1.3}"
MAX_P99_MS="${MAX_P99_MS:-250}"
BENCH_ARGS="${BENCH_ARGS:---limit 2 --max-new-tokens 64}"
model_args=()
if [[ -n "${MODEL:-}" ]]; then model_args=(-m "$MODEL"); fi

echo "pipeline: 1/3 add-heads from $RECIPE" >&2
"$MTPCTL" add-heads --recipe "$RECIPE" "${model_args[@]}" --out "$WORK/heads" --overwrite

echo "pipeline: 2/3 export with the heads fused in" >&2
# a head folder names its target (and the weights hash it was trained on)
"$MTPCTL" export "$WORK/heads" --onnx "$WORK/onnx" --overwrite

echo "pipeline: 3/3 bench the exported graph with gates" >&2
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
"$MTPCTL" bench --backend onnxruntime -m "$WORK/onnx" --methods plain,heads --heads "$WORK/heads" \
    $BENCH_ARGS --json "$WORK/bench.json" \
    --fail-below-speedup "$MIN_SPEEDUP" --fail-above-p99-ms "$MAX_P99_MS"
echo "pipeline: passed; figures in $WORK/bench.json" >&2
