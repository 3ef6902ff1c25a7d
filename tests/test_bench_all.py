"""benchmarks/bench_all.py's file assembly: sections kept or replaced in their order, and the provenance
line that says which commit and CPU the figures come from."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_all  # noqa: E402

INTEL = "Intel(R) Xeon(R) Processor, 2 logical CPUs (native matmul: avx512-bf16), 2 threads, torch 2.13.0+cpu"
AMD = "AMD EPYC, 2 logical CPUs (native matmul: avx512-bf16), 2 threads, torch 2.13.0+cpu"


def section(key: str, measured: str) -> str:
    return f"<!-- section:{key} -->\n## {key}\n\nAbout {key}.\n\n{measured}\n\n| a |\n|---|\n| 1 |\n"


def test_provenance_names_the_common_commit_and_every_section_measured_elsewhere():
    sections = {"peers": section("peers", f"Measured 2026-12-07 at commit f837718 on {INTEL}."),
                "methods": section("methods", f"Measured 2026-12-07 at commit f837718 on {INTEL}."),
                "draft": section("draft", f"Measured 2026-12-02 at commit 052da43 (with uncommitted changes) on {AMD}."),
                "passcosts": section("passcosts", "Measured 2026-12-03: the pass costs at commit 1e91dd1, the "
                                                  f"drafting costs at commit 7d99b80 (the feature layers on tiles), on {AMD}."),
                "gpu": "<!-- section:gpu -->\n## gpu\n\nNot measured yet.\n"}
    line = bench_all.provenance(sections)
    assert line == ("Provenance: 2 of 5 sections measured at commit f837718 on Intel(R) Xeon(R) Processor, "
                    "2026-12-07; the others: draft (052da43 (with uncommitted changes) on AMD EPYC, 2026-12-02); "
                    "passcosts (1e91dd1 on AMD EPYC, 2026-12-03); gpu (not measured).")


def test_assemble_keeps_old_sections_replaces_fresh_ones_and_heads_them_with_provenance():
    old = "# Benchmarks\n\nold header\n\n" + section("peers", f"Measured 2026-12-01 at commit aaaaaaa on {AMD}.") \
        + section("methods", f"Measured 2026-12-01 at commit aaaaaaa on {AMD}.")
    fresh = {"methods": section("methods", f"Measured 2026-12-07 at commit bbbbbbb on {INTEL}.")}
    text = bench_all.assemble(old, fresh, ["peers", "methods", "cpu"])
    assert "old header" not in text and text.startswith("# Benchmarks\n")
    assert text.index("<!-- section:peers -->") < text.index("<!-- section:methods -->") < text.index(
        "<!-- section:cpu -->")
    assert "commit aaaaaaa on AMD" in text and "commit bbbbbbb on Intel" in text
    assert "at commit aaaaaaa on AMD EPYC" not in text.split("<!-- section:methods -->")[1]  # replaced
    assert "## cpu\n\n(not measured yet)" in text
    provenance = [line for line in text.splitlines() if line.startswith("Provenance:")]
    assert provenance == ["Provenance: 1 of 3 sections measured at commit aaaaaaa on AMD EPYC, 2026-12-01; the "
                          "others: methods (bbbbbbb on Intel(R) Xeon(R) Processor, 2026-12-07); cpu (not measured)."]
