"""Write a synthetic checkpoint (a shape file's config, random bfloat16 weights, SmolLM2's tokenizer)
for tests and benchmarks at scale (mtpctl.model.synthetic).

    python benchmarks/synth_checkpoint.py --shape benchmarks/shapes/llama-3.2-1b-like.json --out /tmp/llama-1b-like --shards 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mtpctl.model.config import DecoderConfig
from mtpctl.model.sources import resolve_model
from mtpctl.model.synthetic import checkpoint_bytes, write_synthetic_checkpoint


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=Path, required=True, help="a config.json dict (benchmarks/shapes/*.json)")
    p.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", default="smollm2-135m",
                   help="a model (alias or folder) whose tokenizer files are copied")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    config = json.loads(args.shape.read_text(encoding="utf-8"))
    start = time.perf_counter()
    write_synthetic_checkpoint(args.out, config, args.shards, args.seed, resolve_model(args.tokenizer_from),
                               overwrite=args.overwrite)
    size = checkpoint_bytes(DecoderConfig.from_dict(config))
    print(f"wrote {args.out}: {size / 2**30:.2f} GiB of bfloat16 weights in {args.shards} shard(s), "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
