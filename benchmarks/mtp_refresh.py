"""The goal setup of ``add-heads --kind mtp`` (tests/test_mtp_refresh.py), with figures: a tiny random
glm4_moe checkpoint whose one MTP layer is random (written in two shards), refreshed on its body
("trained"); its body's last layer then redrawn, a stand-in for fine-tuning it ("body changed"); the
layer refreshed again on the new body ("restored").

For each checkpoint: the teacher-forced acceptance by depth that ``add-heads --kind mtp`` reports
(held-out sequences of the 120 self-distilled prompts), and the acceptance by depth of decoding 12 of
those prompts with ``--speculate mtp --draft-len 3`` (greedy, every step drafting, as ``mtpctl bench``
counts it). About a minute on a 2-core CPU; the checkpoint and prompts are the tests' (tests/ on the
path)::

    .venv/bin/python benchmarks/mtp_refresh.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mtpctl  # noqa: E402
from mtpctl.bench.harness import acceptance_by_position  # noqa: E402
from mtpctl.train.mtp_refresh import refresh_mtp  # noqa: E402
from mtpctl.train.settings import TrainSettings  # noqa: E402

DECODED = 12


def source_checkpoint(root: Path) -> Path:
    """The tests' tiny glm4_moe checkpoint with a random MTP layer, in two shards."""
    from safetensors.torch import load_file, save_file

    from helpers import copy_tokenizer_files, write_tiny_checkpoint
    from test_mtp_refresh import _shard
    from test_native_mtp import _mtp_tensors, _reference

    one = root / "one-shard"
    _reference("glm4_moe").save_pretrained(str(one))
    tensors = load_file(str(one / "model.safetensors"))
    save_file({**tensors, **_mtp_tensors(tensors, seed=10)}, str(one / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = write_tiny_checkpoint(root / "tokenizer")
    copy_tokenizer_files(tokenizer, one)
    return _shard(one, root / "source")


def decoded_acceptance(folder: Path, prompts) -> list:
    llm = mtpctl.load(str(folder), speculate="mtp", dtype="float32", threads=1, speculate_policy="always", draft_len=3)
    return [round(a, 3) for a in acceptance_by_position([llm.generate(p, max_new_tokens=24) for p in prompts])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the checkpoints here (default: a temp folder)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="mtp-refresh-"))
    root.mkdir(parents=True, exist_ok=True)
    from test_mtp_refresh import WORDS, _body_changed, _settings

    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(120)]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    settings: TrainSettings = _settings(num_heads=3)
    source = source_checkpoint(root)
    rows = []
    first = refresh_mtp(source, [data], root / "trained", settings, root / "home", device="cpu")
    rows.append(("source (random MTP layer)", first["before"], source))
    rows.append(("trained (refreshed on its body)", first["after"], root / "trained"))
    changed = _body_changed(root / "trained", root / "changed")
    again = refresh_mtp(changed, [data], root / "restored", settings, root / "home", device="cpu")
    rows.append(("body changed (stale MTP layer)", again["before"], changed))
    rows.append(("restored (refreshed again)", again["after"], root / "restored"))
    print(f"settings: {json.dumps({k: first['settings'][k] for k in ('num_heads', 'steps', 'lr', 'batch_tokens', 'head_decay')})}\n")
    print("| checkpoint | teacher-forced acceptance by depth (held-out) | decoded acceptance by depth |")
    print("|---|---|---|")
    for name, measured, folder in rows:
        print(f"| {name} | {measured['acceptance']} | {decoded_acceptance(folder, prompts[:DECODED])} |")


if __name__ == "__main__":
    main()
