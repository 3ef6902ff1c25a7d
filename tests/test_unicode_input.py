"""Text that is not valid Unicode (a lone surrogate such as "\\ud800", which JSON escapes and Python
strings can hold but UTF-8 cannot) and bytes that are not UTF-8 get one clear error on every path: the
tokenizer (prompt, message role and content), the library, and the CLI's argument, stdin and
--prompt-file; never a traceback or exit 3. Batch records: tests/test_cli_batch.py."""

import io
import json
import sys

import pytest

from helpers import assert_one_line_exit_2, cli
from mtpctl.errors import BadInput


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def codec(tiny_folder):
    from mtpctl.model.tokenizer import TextCodec

    return TextCodec(tiny_folder)


@pytest.fixture(scope="module")
def llm(tiny_folder):
    import mtpctl

    return mtpctl.load(str(tiny_folder), threads=1)


@pytest.mark.parametrize("chat", [True, False])
def test_a_prompt_with_a_lone_surrogate_is_refused_naming_it_and_where(codec, chat):
    with pytest.raises(BadInput) as err:
        codec.encode_prompt("bad \ud800 x", chat=chat)
    assert str(err.value) == "the prompt is not valid Unicode (a lone surrogate U+D800 at character 5)"


@pytest.mark.parametrize("message, fragment", [
    ({"role": "user", "content": "\udfff"}, "message 2's content is not valid Unicode (a lone surrogate U+DFFF at "
                                            "character 1)"),
    ({"role": "us\ud800er", "content": "hi"}, "message 2's role is not valid Unicode (a lone surrogate U+D800 at "
                                              "character 3)"),
    ({"role": "user"}, "message 2's content must be a string, got NoneType"),
    ({"role": 1, "content": "hi"}, "message 2's role must be a string, got int"),
    ("hi", "message 2 must be a {\"role\": string, \"content\": string} object, got str"),
])
def test_a_conversation_with_a_bad_role_or_content_is_refused_naming_the_message(codec, message, fragment):
    with pytest.raises(BadInput) as err:
        codec.encode_messages([{"role": "user", "content": "fine"}, message])
    assert str(err.value) == fragment


def test_valid_text_outside_the_basic_plane_still_tokenizes(codec):
    """Surrogate pairs written as JSON escapes decode to one valid character: not refused."""
    text = json.loads('"smile \\ud83d\\ude00"')
    assert codec.encode_prompt(text) == codec.encode_prompt("smile \U0001F600")


@pytest.mark.parametrize("prompt, fragment", [
    ("\ud800", "the prompt is not valid Unicode (a lone surrogate U+D800 at character 1)"),
    ([{"role": "user", "content": "a\udc00"}], "message 1's content is not valid Unicode"),
    ([{"role": "\ud800", "content": "hi"}], "message 1's role is not valid Unicode"),
    ([], "the prompt is empty"),
    (None, "a prompt is a string, a list of messages or a list of token ids, got NoneType"),
    ([1.5], "a prompt of token ids must hold integers"),
    ([10 ** 9], "a prompt's token ids must be from 0 to"),
])
def test_the_library_refuses_text_that_is_not_valid_unicode_with_bad_input(llm, prompt, fragment):
    with pytest.raises(BadInput) as err:
        llm.generate(prompt, max_new_tokens=2)
    assert fragment in str(err.value)


def test_the_library_still_takes_token_ids_as_they_are(llm):
    ids = llm.encode("hello")
    assert llm.encode(tuple(ids)) == ids
    assert llm.generate(ids, max_new_tokens=3).token_ids == llm.generate("hello", max_new_tokens=3).token_ids


@pytest.mark.parametrize("prompt, fragment", [
    ("ab\udcff", "the prompt argument is not UTF-8 text (byte 0xff at character 3)"),  # byte 0xff in argv
    ("\udced\udca0\udc80", "the prompt argument is not UTF-8 text (byte 0xed at character 1)"),  # UTF-8 of U+D800
    ("x\ud800", "the prompt argument is not UTF-8 text (a lone surrogate U+D800 at character 2)"),
])
def test_an_argument_that_is_not_utf8_is_one_clear_error(capsys, tiny_folder, prompt, fragment):
    code, out, err = cli(capsys, "generate", "-m", tiny_folder, "--json", prompt)
    assert_one_line_exit_2(code, out, err, fragment)


def test_stdin_holding_an_encoded_surrogate_is_one_clear_error(capsys, tiny_folder, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok \xed\xa0\x80 then")))
    code, out, err = cli(capsys, "generate", "-m", tiny_folder, "-")
    assert_one_line_exit_2(code, out, err, "the prompt on stdin is not UTF-8 text (byte 0xed at offset 3)")


def test_a_prompt_file_holding_an_encoded_surrogate_is_one_clear_error(capsys, tiny_folder, tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"hello \xed\xbf\xbf")
    code, out, err = cli(capsys, "generate", "-m", tiny_folder, "--prompt-file", path)
    assert_one_line_exit_2(code, out, err, f"prompt file {path} is not UTF-8 text (byte 0xed at offset 6)")


@pytest.mark.parametrize("line", ['{"text": "a \\ud800 b"}', '{"prompt": "x \\udfff"}',
                                  '{"messages": [{"role": "user", "content": "\\ud800"}]}'])
def test_training_data_that_is_not_valid_unicode_is_refused_naming_its_line(tmp_path, line):
    from mtpctl.train.distill import read_records

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "fine text here"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(BadInput, match=r"data.jsonl:2: .*not valid Unicode"):
        read_records([data])
