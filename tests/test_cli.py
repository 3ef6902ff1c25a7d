"""The CLI on the tiny checkpoint: products on stdout, one-line errors with exit code 2 on stderr."""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from mtpctl.cli.main import main


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, fragment):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mtpctl: error:") and fragment in lines[0], lines[0]
    assert "Traceback" not in err


def tree_digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_generate_json_plain_and_ngram_agree(capsys, tiny_folder):
    results = []
    for extra in ([], ["--speculate", "ngram", "--draft-len", "3"]):
        code, out, err = cli(capsys, "generate", "--model", tiny_folder, "--json", "--max-new-tokens", 24,
                             "abcabcabc", *extra)
        assert code == 0, err
        results.append(json.loads(out))
    plain, spec = results
    assert plain["token_ids"] == spec["token_ids"]
    assert len(plain["token_ids"]) <= 24
    assert plain["stats"]["tau"] == 1.0 and spec["stats"]["new_tokens"] == len(spec["token_ids"])
    assert spec["speculate"] == "ngram" and spec["draft_len"] == 3


def test_seeded_sampling_gives_the_same_tokens_with_prompt_lookup_and_json_says_so(capsys, tiny_folder):
    results = {}
    for speculate in ("none", "ngram"):
        code, out, err = cli(capsys, "generate", "--model", tiny_folder, "--json", "--max-new-tokens", 24, "--temperature",
                             0.9, "--seed", 5, "--speculate", speculate, "--speculate-policy", "always", "abcabcabc")
        assert code == 0, err
        results[speculate] = json.loads(out)
    assert results["none"]["token_ids"] == results["ngram"]["token_ids"]
    assert results["none"]["seeded_sampling"] == results["ngram"]["seeded_sampling"] == "reproducible"
    code, out, err = cli(capsys, "generate", "--model", tiny_folder, "--json", "--max-new-tokens", 8, "--temperature",
                         0.9, "--seed", 5, "--speculate", "draft", "--draft", tiny_folder, "abcabcabc")
    assert code == 0, err
    assert json.loads(out)["seeded_sampling"] == "drafter-dependent"  # a draft model samples its own chain


def test_generate_streams_text_and_stats_go_to_stderr(capsys, tiny_folder):
    code, out, err = cli(capsys, "generate", "-m", tiny_folder, "--max-new-tokens", 8, "--stats", "--no-chat", "hello")
    assert code == 0
    assert "tau=" in err and "tau=" not in out
    code, js, _ = cli(capsys, "generate", "-m", tiny_folder, "--max-new-tokens", 8, "--json", "--no-chat", "hello")
    assert out == json.loads(js)["text"] + "\n"
    from mtpctl.model.native import load_kernel
    assert json.loads(js)["attention"] == ("native" if load_kernel() is not None else "torch")


def test_generate_json_says_when_torch_attention_ran(capsys, tiny_folder, monkeypatch):
    from mtpctl.model.native import load_kernel
    monkeypatch.setenv("MTPCTL_NATIVE_KERNELS", "off")
    load_kernel.cache_clear()
    try:
        code, js, err = cli(capsys, "generate", "-m", tiny_folder, "--max-new-tokens", 4, "--json", "--no-chat", "hi")
    finally:
        load_kernel.cache_clear()
    assert code == 0 and json.loads(js)["attention"] == "torch" and "warning" not in err  # on purpose: silent


@pytest.mark.parametrize("switch", ["on", "off"])
def test_generate_json_says_what_int4_weights_ran_on(capsys, tmp_path, monkeypatch, switch):
    from helpers import write_gguf_grid_checkpoint

    from mtpctl.model.native import load_kernel
    folder = str(write_gguf_grid_checkpoint(tmp_path / "grid"))
    monkeypatch.setenv("MTPCTL_NATIVE_KERNELS", switch)
    load_kernel.cache_clear()
    try:
        code, js, err = cli(capsys, "generate", "-m", folder, "--dtype", "bfloat16", "--weights", "int4",
                            "--max-new-tokens", 4, "--json", "--no-chat", "hi")
        native = load_kernel() is not None
        code_dense, js_dense, _ = cli(capsys, "generate", "-m", folder, "--max-new-tokens", 2, "--json", "--no-chat", "hi")
    finally:
        load_kernel.cache_clear()
    assert code == 0, err
    assert json.loads(js)["int4_kernel"] == ("native" if native else "torch")
    assert code_dense == 0 and json.loads(js_dense)["int4_kernel"] is None
    isa = json.loads(js)["matmul_isa"]  # the path this CPU's build of int4_matmul.c takes, null without it
    assert (isa in ("avx512-bf16", "avx2", "portable")) if native else isa is None
    assert json.loads(js_dense)["matmul_isa"] is None  # float32: no weight on the native matmuls


def test_prompt_from_stdin_and_file(capsys, tiny_folder, tmp_path, monkeypatch):
    import io

    args = ["generate", "-m", tiny_folder, "--max-new-tokens", 5, "--json"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"tell me")))
    code, from_stdin, _ = cli(capsys, *args, "-")
    (tmp_path / "p.txt").write_text("tell me")
    code2, from_file, _ = cli(capsys, *args, "--prompt-file", tmp_path / "p.txt")
    code3, from_arg, _ = cli(capsys, *args, "tell me")
    assert code == code2 == code3 == 0
    assert json.loads(from_stdin)["token_ids"] == json.loads(from_file)["token_ids"] == json.loads(from_arg)["token_ids"]


@pytest.mark.parametrize("args, fragment", [
    (["   "], "prompt is empty"),
    (["x" * 300], "context holds"),
    (["--max-new-tokens", "0", "hi"], "max-new-tokens"),
    (["--max-new-tokens", "-3", "hi"], "max-new-tokens"),
    (["--draft-len", "0", "--speculate", "ngram", "hi"], "draft-len"),
    (["--top-p", "0", "hi"], "top-p"),
    (["--top-p", "1.5", "hi"], "top-p"),
    (["--ngram-min", "4", "--ngram-max", "2", "--speculate", "ngram", "hi"], "ngram-min"),
    ([], "no prompt"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
])
def test_bad_generate_arguments(capsys, tiny_folder, args, fragment):
    code, out, err = cli(capsys, "generate", "--model", tiny_folder, *args)
    assert_one_line_error(code, err, fragment)
    assert out == ""


@pytest.mark.parametrize("model, fragment", [
    ("no-such-alias", "unknown model"),
    ("./missing/folder", "unknown model"),
    ("some-org/some-model", "hub"),
    ("/nonexistent/model.gguf", "no such GGUF file"),
])
def test_missing_models(capsys, model, fragment):
    assert_one_line_error(*cli(capsys, "generate", "--model", model, "hi")[::2], fragment)


def broken_copy(tiny_folder, tmp_path, how):
    folder = shutil.copytree(tiny_folder, tmp_path / "broken")
    weights = folder / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:5000])
    elif how == "no-tokenizer":
        (folder / "tokenizer.json").unlink()
    elif how == "no-config":
        (folder / "config.json").unlink()
    return folder


@pytest.mark.parametrize("how, fragment", [
    ("truncated", "not a readable safetensors"),
    ("no-tokenizer", "no tokenizer"),
    ("no-config", "no config.json"),
])
def test_broken_checkpoints_fail_cleanly_and_stay_untouched(capsys, tiny_folder, tmp_path, how, fragment):
    folder = broken_copy(tiny_folder, tmp_path, how)
    before = tree_digest(folder)
    assert_one_line_error(*cli(capsys, "generate", "--model", folder, "hi")[::2], fragment)
    assert tree_digest(folder) == before


def test_corrupt_gguf_fails_cleanly_and_leaves_no_import(capsys, tmp_path):
    gguf = tmp_path / "junk.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    assert_one_line_error(*cli(capsys, "generate", "--model", gguf, "hi")[::2], "junk.gguf")
    models = tmp_path / "home" / "models"
    assert not models.exists() or list(models.iterdir()) == []
    assert gguf.read_bytes()[:4] == b"GGUF"


def test_debug_shows_the_traceback(tiny_folder):
    with pytest.raises(Exception, match="prompt is empty"):
        main(["--debug", "generate", "--model", str(tiny_folder), " "])


def test_models_list_json(capsys):
    code, out, _ = cli(capsys, "models", "list", "--json")
    rows = {r["alias"]: r for r in json.loads(out)}
    assert code == 0 and rows["smollm2-135m"]["default"] and "gemma3-270m" in rows


def test_console_entry_point_exit_codes(tiny_folder, tmp_path):
    """The real process: product on stdout, one line on stderr, exit code 2 on bad input."""
    env_cmd = [sys.executable, "-m", "mtpctl", "generate", "--model", str(tiny_folder)]
    ok = subprocess.run(env_cmd + ["--max-new-tokens", "4", "--json", "hi"], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["stats"]["new_tokens"] <= 4
    bad = subprocess.run(env_cmd + ["--top-p", "2", "hi"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1


def test_closed_stdout_stops_quietly_with_141(tiny_folder):
    """`mtpctl generate ... | head -c 1`: no traceback, exit code 141 like a Unix tool on SIGPIPE.
    The pipe's read end is closed before the child writes, so its first write fails."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = subprocess.Popen([sys.executable, "-m", "mtpctl", "generate", "--model", str(tiny_folder), "--no-chat",
                             "--max-new-tokens", "20", "hello"], stdout=write_end, stderr=subprocess.PIPE)
    os.close(write_end)
    err = proc.stderr.read().decode()
    assert proc.wait() == 141
    assert "Traceback" not in err and err == ""
