"""README.md's current-figures table is BENCHMARKS.md's, as benchmarks/readme_figures.py writes it."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import readme_figures  # noqa: E402


def test_the_readme_table_is_generated_from_benchmarks_md():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme_figures.figures((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))
    assert readme_figures.replace_block(readme, table) == readme, \
        "README.md's figures differ from BENCHMARKS.md: .venv/bin/python benchmarks/readme_figures.py --write README.md"


def test_the_table_reads_each_modes_rows_from_the_methods_section():
    text = """<!-- section:methods -->
Measured at commit abc1234 on a CPU.

`.venv/bin/mtpctl bench --methods plain,heads+ngram --limit 2`

| method | tokens/s | speedup (p10-p90) | TTFT | ITL | tau |
|---|---:|---:|---:|---:|---:|
| plain | 10.0 | 1.00 (baseline) | 1 | 1 | 1.00 |
| heads+ngram | 15.0 | 1.40 (1.1-1.6) | 1 | 1 | 1.70 |

`.venv/bin/mtpctl bench --dtype bfloat16 --weights int4 --methods plain,heads+ngram --limit 2`

| method | tokens/s | speedup (p10-p90) | TTFT | ITL | tau |
|---|---:|---:|---:|---:|---:|
| plain | 50.0 | 1.00 (baseline) | 1 | 1 | 1.00 |
| heads+ngram | 55.0 | 1.05 (0.9-1.2) | 1 | 1 | 1.30 |
"""
    lines = readme_figures.figures(text).splitlines()
    assert lines[2] == "| float32 | 10.0 | 15.0 | 1.40x | 1.70 |  |"
    assert lines[3] == "| int4 weights | 50.0 | 55.0 | 1.05x | 1.30 |  |"
    assert "commit abc1234" in lines[-1]
