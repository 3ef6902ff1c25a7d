"""``mtpctl bench --baseline``: every peer in its own process, so a peer that crashes, hangs or cannot
import costs its own row and nothing else (stand-in llama.cpp packages play the faulty peer)."""

import json
import shutil
import sys
import textwrap
import time

import pytest

from mtpctl.bench.peer_process import PeerFailed, PeerProcess
from mtpctl.bench.vllm_peer import vllm_peers
from mtpctl.cli.main import main

#: stand-in llama_cpp packages: a ``Llama`` whose second ``generate`` (the first timed run; the
#: first is the warm-up) crashes with SIGSEGV or hangs, or a package whose import fails
FAKE_LLAMA = {
    "segfault": """
        import os, signal
        __version__ = "0.0-stand-in"
        def llama_print_system_info():
            return b"AVX2 = 1 | AMX_INT8 = 0"
        class Llama:
            calls = 0
            def __init__(self, **kwargs): pass
            def reset(self): pass
            def generate(self, tokens, **kwargs):
                Llama.calls += 1
                if Llama.calls == 2:
                    os.kill(os.getpid(), signal.SIGSEGV)
                yield 5
    """,
    "hang": """
        import time
        __version__ = "0.0-stand-in"
        def llama_print_system_info():
            return b"AVX2 = 1"
        class Llama:
            def __init__(self, **kwargs): pass
            def reset(self): pass
            def generate(self, tokens, **kwargs):
                time.sleep(600)
                yield 5
    """,
    "import": """
        raise ImportError("libllama.so: cannot open shared object file")
    """,
}


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"category": "copy", "prompt": p}) for p in ("abc abc abc", "xyz xyz")))
    return path


@pytest.fixture
def gguf_model(tiny_folder, tmp_path):
    """The tiny checkpoint, recorded as imported from a (stand-in) GGUF file, as llama.cpp's peer needs."""
    folder = shutil.copytree(tiny_folder, tmp_path / "model")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (folder / "mtpctl_import.json").write_text(json.dumps({"format_version": 1, "source": str(tmp_path / "model.gguf")}))
    return folder


def fake_llama_cpp(tmp_path, monkeypatch, kind: str) -> None:
    """Put a stand-in ``llama_cpp`` package first on this process's path and the peer's."""
    package = tmp_path / "fake" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_LLAMA[kind]))
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setenv("PYTHONPATH", str(package.parent))


def bench_llamacpp(capsys, model, prompt_file, tmp_path, *extra):
    code = main(["bench", "--model", str(model), "--prompts", str(prompt_file), "--methods", "plain,ngram",
                 "--max-new-tokens", "8", "--baseline", "llama.cpp", "--json", str(tmp_path / "b.json"), *extra])
    out, err = capsys.readouterr()
    return code, out, err, json.loads((tmp_path / "b.json").read_text())


def assert_only_the_peer_failed(report: dict, reason: str) -> None:
    rows = {m["method"]: m for m in report["methods"]}
    assert list(rows) == ["plain", "ngram", "llama.cpp"]
    assert reason in rows["llama.cpp"]["failed"] and rows["llama.cpp"]["tokens_per_s"] is None
    for name in ("plain", "ngram"):
        assert "failed" not in rows[name] and rows[name]["runs"] == 2 and rows[name]["tokens_per_s"] > 0
    assert rows["ngram"]["same_as_plain"] == 2
    assert set(report["tokens_per_s_by_category"]["copy"]) == {"plain", "ngram"}


def test_a_peer_killed_by_sigsegv_leaves_the_other_rows_and_the_json(capsys, gguf_model, prompt_file, tmp_path,
                                                                     monkeypatch):
    fake_llama_cpp(tmp_path, monkeypatch, "segfault")
    code, out, err, report = bench_llamacpp(capsys, gguf_model, prompt_file, tmp_path)
    assert code == 4
    assert_only_the_peer_failed(report, "killed by SIGSEGV")
    assert report["methods"][2]["runs"] == 0  # the warm-up passed, the first timed run crashed
    assert "| llama.cpp | failed after 0 run(s): killed by SIGSEGV" in out
    assert report["settings"]["peer_builds"] == {"llama.cpp": {"llama_cpp_python": "0.0-stand-in",
                                                               "system_info": "AVX2 = 1 | AMX_INT8 = 0"}}
    assert "crashed in " in report["methods"][2]["failed"] and "llama_cpp/__init__.py" in report["methods"][2]["failed"]
    last = err.strip().splitlines()[-1]
    assert "peer failed" in last and "llama.cpp: killed by SIGSEGV" in last and "Traceback" not in err


def test_a_peer_that_hangs_is_stopped_after_the_peer_timeout(capsys, gguf_model, prompt_file, tmp_path, monkeypatch):
    fake_llama_cpp(tmp_path, monkeypatch, "hang")
    start = time.monotonic()
    code, out, err, report = bench_llamacpp(capsys, gguf_model, prompt_file, tmp_path, "--peer-timeout", "3")
    assert code == 4 and time.monotonic() - start < 120
    assert_only_the_peer_failed(report, "no answer within 3 s (killed)")


def test_a_peer_whose_import_fails_is_a_failed_row(capsys, gguf_model, prompt_file, tmp_path, monkeypatch):
    fake_llama_cpp(tmp_path, monkeypatch, "import")
    code, out, err, report = bench_llamacpp(capsys, gguf_model, prompt_file, tmp_path)
    assert code == 4
    assert_only_the_peer_failed(report, "ImportError: libllama.so: cannot open shared object file")
    assert report["settings"]["peer_builds"] == {"llama.cpp": None}  # it never started


def test_a_missed_gate_exits_1_before_a_failed_peer(capsys, gguf_model, prompt_file, tmp_path, monkeypatch):
    fake_llama_cpp(tmp_path, monkeypatch, "segfault")
    code, out, err, report = bench_llamacpp(capsys, gguf_model, prompt_file, tmp_path, "--fail-below-speedup", "1000")
    assert code == 1 and "gate missed: ngram speedup" in err
    assert_only_the_peer_failed(report, "killed by SIGSEGV")


def test_the_transformers_peer_runs_in_its_own_process_and_equals_plain(capsys, tiny_folder, prompt_file, tmp_path):
    code = main(["bench", "--model", str(tiny_folder), "--prompts", str(prompt_file), "--methods", "plain",
                 "--max-new-tokens", "8", "--baseline", "transformers", "--json", str(tmp_path / "b.json")])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "b.json").read_text())
    rows = {m["method"]: m for m in report["methods"]}
    assert list(rows) == ["plain", "hf", "hf-prompt-lookup"]
    assert rows["hf"]["same_as_plain"] == rows["hf"]["runs"] == 2  # float32 greedy: transformers' tokens are ours
    assert rows["hf-prompt-lookup"]["same_as_plain"] == 2
    import transformers
    assert report["settings"]["peer_builds"]["hf"] == {"transformers": transformers.__version__}


def test_a_failed_vllm_peer_is_its_row_and_the_next_peer_still_runs(tmp_path, monkeypatch):
    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\ncat > /dev/null\necho 'RuntimeError: engine core died' >&2\nkill -SEGV $$\n")
    crashing.chmod(0o755)
    monkeypatch.setenv("MTPCTL_VLLM_PYTHON", str(crashing))
    runs, figures = vllm_peers(tmp_path, {"vllm": (None, True), "vllm-ngram": ({"method": "ngram"}, True)},
                               [[1, 2, 3]], 1, 4, "float32", 1, [0])
    for name in ("vllm", "vllm-ngram"):
        assert runs[name].failed == "vLLM failed (killed by SIGSEGV): RuntimeError: engine core died"
        assert figures[name] == {}


def test_a_peer_process_fails_every_message_after_its_end(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text("import sys, json\nsys.stdin.readline()\nprint(json.dumps({'ready': True}), flush=True)\n"
                      "sys.stdin.readline()\nsys.stderr.write('bye\\n')\nsys.exit(7)\n")
    peer = PeerProcess("stand-in", {}, timeout_s=30, command=[sys.executable, str(script)])
    assert peer.ready == {"ready": True}
    for _ in range(2):  # the second message fails at once, with the same reason
        with pytest.raises(PeerFailed, match=r"^exited with code 7 \(bye\)$"):
            peer.ask({"prompt_ids": [1]})
    peer.close()


def glm_with_mtp_at_46(root):
    """A tiny glm4_moe checkpoint of 46 layers with one MTP layer at ``model.layers.46`` (GLM-4.5-Air's
    layout, which transformers' MTP loader finds by that number), with the tiny tokenizer."""
    from safetensors.torch import load_file, save_file

    from helpers import copy_tokenizer_files, random_reference_model, write_tiny_checkpoint
    from test_glm_deepseek_families import COMMON, EXTRA
    from test_native_mtp import _mtp_tensors

    folder = root / "glm46"
    random_reference_model("glm4_moe", **{**COMMON, "num_hidden_layers": 46, "hidden_size": 32,
                                          "num_nextn_predict_layers": 1},
                           **{**EXTRA["glm4_moe"], "head_dim": 8}).save_pretrained(str(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, **_mtp_tensors(tensors, seed=3, layers=46)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return copy_tokenizer_files(write_tiny_checkpoint(root / "tokenizer"), folder)


def test_the_transformers_mtp_peer_drafts_with_the_checkpoints_own_layers(capsys, prompt_file, tmp_path, tiny_folder):
    folder = glm_with_mtp_at_46(tmp_path)
    code = main(["bench", "--model", str(folder), "--prompts", str(prompt_file), "--methods", "plain,mtp",
                 "--max-new-tokens", "12", "--baseline", "transformers-mtp", "--json", str(tmp_path / "b.json")])
    assert code == 0, capsys.readouterr().err
    rows = {m["method"]: m for m in json.loads((tmp_path / "b.json").read_text())["methods"]}
    assert list(rows) == ["plain", "mtp", "hf", "hf-mtp"]
    # float32 greedy: transformers' tokens, drafted by its MTPCandidateGenerator or not, are mtpctl's plain ones
    assert rows["mtp"]["same_as_plain"] == rows["hf"]["same_as_plain"] == rows["hf-mtp"]["same_as_plain"] == 2
    capsys.readouterr()
    code = main(["bench", "--model", str(tiny_folder), "--prompts", str(prompt_file), "--baseline", "transformers-mtp"])
    err = capsys.readouterr().err
    assert code == 2 and "MTP layers of llama checkpoints are not read" in err and len(err.strip().splitlines()) == 1
