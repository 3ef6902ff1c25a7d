"""The recipes' self-distillation prompts: readable, without duplicates, and apart from the benchmark
prompts (so that the benchmark measures the heads on prompts they never saw)."""

import json
import re
from pathlib import Path

import pytest
import yaml

from mtpctl.train.distill import read_records

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
BENCH_FILES = [ROOT / "mtpctl" / "data" / "bench_prompts.jsonl"]  # the built-in prompt set every benchmark uses
RUN = 10  # words: a prompt sharing this many consecutive words with a benchmark prompt is too close


def _text(record) -> str:
    return record.text or " ".join(m["content"] for m in record.messages)


def _runs(text: str) -> set:
    words = re.sub(r"\W+", " ", text.lower()).split()
    return {" ".join(words[i:i + RUN]) for i in range(len(words) - RUN + 1)}


def _recipe_files(recipe: Path) -> list:
    return [recipe.parent / p for p in yaml.safe_load(recipe.read_text())["data"]]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_prompts_are_distinct_and_parse(recipe):
    records = read_records(_recipe_files(recipe))
    texts = [_text(r) for r in records]
    assert len(texts) >= 1500
    assert len(set(texts)) == len(texts), "a prompt appears twice"


def test_hand_written_prompts_share_no_long_run_with_the_benchmark_prompts():
    bench = set().union(*(_runs(_text(r)) for r in read_records(BENCH_FILES)))
    written = sorted((ROOT / "recipes" / "data").glob("written_*.jsonl"))
    assert written
    close = [_text(r)[:60] for r in read_records(written) if _runs(_text(r)) & bench]
    assert close == []


def test_hand_written_records_are_prompts_or_chats_ending_with_a_user_turn():
    for path in sorted((ROOT / "recipes" / "data").glob("written_*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            row = json.loads(line)
            if "messages" in row:
                roles = [m["role"] for m in row["messages"]]
                assert roles[-1] == "user" and set(roles) <= {"user", "assistant"}, f"{path.name}:{number}"
            else:
                assert row["prompt"].strip(), f"{path.name}:{number}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_settings_are_valid(recipe):
    """Every recipe's settings fill TrainSettings and pass its checks (a typo is caught here, not an hour in)."""
    from mtpctl.cli.add_heads import read_recipe
    from mtpctl.train.settings import TrainSettings

    spec = read_recipe(str(recipe))
    settings = TrainSettings(**spec["settings"])
    settings.check()
    assert settings.self_distill and spec["model"] == "smollm2-135m"
