"""Magpie prompts (mtpctl/train/magpie.py): the pre-query template, the screening of the requests
the target writes, their reproducibility, and add-heads with them."""

import json

import pytest

from mtpctl.cli.main import main
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.errors import BadInput
from mtpctl.model.tokenizer import TextCodec
from mtpctl.train import magpie
from mtpctl.train.magpie import Draw, MagpieSettings, MagpieStats, draw_requests, pre_query_template, screen
from mtpctl.train.settings import TrainSettings

SMOLLM2_PRE_QUERY = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                     "<|im_end|>\n<|im_start|>user\n")


@pytest.mark.real
def test_the_pre_query_template_of_smollm2_opens_a_user_turn(smollm2_folder):
    pre = pre_query_template(TextCodec(smollm2_folder))
    assert pre.text == SMOLLM2_PRE_QUERY  # the template's default system turn, then the user's opening
    assert pre.ids[:2] == [1, 9690] and pre.ids[-3:] == [1, 4093, 198]  # <|im_start|>system ... <|im_start|>user\n
    assert pre.end_of_turn == 2  # <|im_end|>


def test_the_pre_query_template_of_the_tiny_model(tiny_folder):
    pre = pre_query_template(TextCodec(tiny_folder))
    assert pre.text == "<|im_start|>user\n" and pre.ids[0] == 257 and pre.end_of_turn == 258


def test_a_model_without_a_chat_template_is_refused(tiny_folder):
    codec = TextCodec(tiny_folder)
    codec.tokenizer.chat_template = None
    with pytest.raises(BadInput, match="no chat template") as err:
        pre_query_template(codec)
    assert "--" not in str(err.value)


def test_the_screen_drops_each_request_for_its_reason():
    draws = [
        Draw("How do I bake sourdough bread at home?", True),
        Draw("   ", True),
        Draw("Write me a long story about a dragon who", False),  # the token limit came first
        Draw("Hello there", True),
        Draw("the cat sat the cat sat the cat sat the cat sat the cat sat on it", True),  # a 3-gram 5 times
        Draw("please please help help me me please help", True),  # 3 distinct words of 8
        Draw("HOW do I   bake sourdough bread at home?!", True),  # the first, normalised
        Draw("How do I bake sourdough bread at home quickly?", True),  # 6 of its 7 shingles are the first's
        Draw("What should I cook for dinner with rice and beans?", True),
        Draw("yes no yes no yes no maybe", True),  # 3 distinct of 7, no 3-gram over 4 times: kept
    ]
    assert screen(draws) == [None, "empty", "unfinished", "too_short", "degenerate", "degenerate", "duplicate",
                             "near_duplicate", None, None]
    stats = MagpieStats.of(screen(draws))
    assert (stats.drawn, stats.kept, stats.duplicate, stats.degenerate) == (10, 3, 1, 2)
    assert stats.line() == ("drawn 10, kept 3; dropped: empty 1, unfinished 1, too_short 1, degenerate 2, "
                            "duplicate 1, near_duplicate 1")


def test_a_near_duplicate_is_judged_against_kept_prompts_only():
    # the second is dropped as too short; the third is far from the first (Jaccard 1/12)
    draws = [Draw("Explain how a hash map stores its keys", True), Draw("Explain", True),
             Draw("Explain how a compiler turns code into machine instructions", True)]
    assert screen(draws) == [None, "too_short", None]


def test_magpie_settings_come_from_a_mapping_and_are_checked():
    settings = TrainSettings(self_distill=True, magpie={"count": 4, "seed": 2})
    assert settings.magpie == MagpieSettings(count=4, seed=2) and settings.magpie_count == 4
    settings.check()
    assert TrainSettings().magpie_count == 0
    with pytest.raises(BadInput, match="unknown magpie setting"):
        TrainSettings(magpie={"count": 4, "temprature": 1.0})
    for bad, words in [(dict(magpie={"count": 4}), "self-distillation"),
                       (dict(self_distill=True, magpie={"count": -1}), "count"),
                       (dict(self_distill=True, magpie={"count": 1, "top_p": 0}), "top_p"),
                       (dict(self_distill=True, magpie={"count": 1, "openings": [""]}), "openings")]:
        with pytest.raises(BadInput, match=words) as err:
            TrainSettings(**bad).check()
        assert "--" not in str(err.value)


def test_each_request_has_its_own_seed():
    a, b = MagpieSettings(seed=0), MagpieSettings(seed=1)
    seeds = {s.sampling(i).seed for s in (a, b) for i in range(50)}
    assert len(seeds) == 100 and a.sampling(3) == MagpieSettings(seed=0).sampling(3)


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_folder):
    """A bfloat16 session on the real SmolLM2-135M-Instruct (add-heads draws in ``distill_dtype``)."""
    from mtpctl.backends.torch import TorchSession

    return TorchSession(smollm2_folder, "bfloat16")


@pytest.mark.real
def test_the_same_settings_draw_the_same_prompts(smollm2_bf16):
    smollm2 = smollm2_bf16
    settings = MagpieSettings(count=6, seed=0, max_prompt_tokens=24)
    first = draw_requests(smollm2, settings)
    assert draw_requests(smollm2, settings) == first
    assert draw_requests(smollm2, MagpieSettings(count=6, seed=0, max_prompt_tokens=24, batch=2)) == first
    other = draw_requests(smollm2, MagpieSettings(count=6, seed=1, max_prompt_tokens=24))
    assert [d.text for d in other] != [d.text for d in first]
    assert all(d.text for d in first) and any(d.ended for d in first + other)


@pytest.mark.real
def test_openings_start_the_requests(smollm2_bf16):
    opening = "Write a Python function that"
    draws = draw_requests(smollm2_bf16, MagpieSettings(count=2, max_prompt_tokens=16, openings=[opening]))
    assert all(d.text.startswith(opening + " ") for d in draws)


KEPT = ["How do I bake sourdough bread at home?", "Count from three to nine, please.",
        "What should I cook for dinner with rice and beans?"]


@pytest.fixture
def fake_draws(monkeypatch):
    """The target's requests replaced by fixed ones (a random tiny model never ends its turn); the
    screening, the cache and add-heads' wiring stay real. Returns the calls' settings."""
    calls = []

    def draw(session, settings, on_done=None, done=None, on_draw=None):
        calls.append(settings)
        assert session.codec.has_chat_template
        draws = [Draw(KEPT[0], True), Draw("Hi", True), Draw(KEPT[1], True), Draw(KEPT[0] + "!", True),
                 Draw(KEPT[2], True)][:settings.count]
        for i, d in enumerate(draws):
            if i not in (done or {}) and on_draw:
                on_draw(i, d)
        return draws

    monkeypatch.setattr(magpie, "draw_requests", draw)
    return calls


def test_add_heads_trains_on_magpie_prompts_alone(tiny_folder, tmp_path, capsys, monkeypatch, fake_draws):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    base = ["add-heads", "-m", str(tiny_folder), "--self-distill", "--num-heads", "2", "--response-tokens", "8",
            "--epochs", "1", "--magpie-prompts", "5"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "magpie: drawn 5, kept 3; dropped: too_short 1, duplicate 1" in err
    assert "features: 3 sequences" in err
    lines = (tmp_path / "a" / magpie.PROMPTS_FILE).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"prompt": p} for p in KEPT]
    training = HeadsConfig.load(tmp_path / "a").training
    assert training["settings"]["magpie"]["count"] == 5 and training["settings"]["magpie"]["seed"] == 0
    assert training["magpie"]["stats"]["kept"] == 3 and training["magpie"]["pre_query"] == "<|im_start|>user\n"
    assert main([*base, "--kind", "hydra", "--out", str(tmp_path / "b")]) == 0  # prompts and features reused
    assert len(fake_draws) == 1 and "magpie: reusing" in capsys.readouterr().err
    assert main([*base, "--magpie-seed", "1", "--out", str(tmp_path / "c")]) == 0  # another seed: drawn again
    assert [s.seed for s in fake_draws] == [0, 1]


def test_add_heads_mixes_magpie_prompts_with_the_data(tiny_folder, tmp_path, capsys, monkeypatch, fake_draws):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"count: {i} {i + 1}"}) + "\n" for i in range(6)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nmodel: {tiny_folder}\ndata: [{data.name}]\nsettings:\n  self_distill: true\n"
                      "  num_heads: 2\n  response_tokens: 8\n  epochs: 1\n  magpie: {count: 3, seed: 4, "
                      "max_prompt_tokens: 32}\n")
    assert main(["add-heads", "--recipe", str(recipe), "--json", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr()
    assert "features: 8 sequences" in out.err  # 6 given, 2 of the 3 drawn kept
    summary = json.loads(out.out)
    assert summary["settings"]["magpie"]["max_prompt_tokens"] == 32 and summary["held_out"] > 0
    assert fake_draws[0] == MagpieSettings(count=3, seed=4, max_prompt_tokens=32)


def test_magpie_prompts_need_self_distillation(tiny_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    code = main(["add-heads", "-m", str(tiny_folder), "--magpie-prompts", "3", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mtpctl: error:")]
    assert code == 2 and len(lines) == 1 and "--self-distill" in lines[0]


@pytest.mark.real
@pytest.mark.slow
def test_add_heads_on_smollm2_with_its_own_prompts(smollm2_folder, tmp_path):
    from mtpctl.train.add_heads import add_heads

    settings = TrainSettings(num_heads=2, self_distill=True, response_tokens=12, epochs=1, tree_nodes=2,
                             magpie={"count": 6, "seed": 0, "max_prompt_tokens": 24})
    summary = add_heads(smollm2_folder, "smollm2-135m", [], tmp_path / "out", settings, tmp_path / "home")
    kept = (tmp_path / "out" / magpie.PROMPTS_FILE).read_text().splitlines()
    stats = summary["magpie"]["stats"]
    assert stats["drawn"] == 6 and stats["kept"] == len(kept) > 0
    assert summary["magpie"]["pre_query"] == SMOLLM2_PRE_QUERY


@pytest.mark.real
def test_a_resumed_draw_keeps_the_requests_drawn_before(smollm2_bf16):
    """Each request has its own seed: the requests an interrupted run drew, given back as ``done``, are
    not drawn again, and the rest come out as one uninterrupted draw gives them."""
    settings = MagpieSettings(count=5, seed=2, max_prompt_tokens=20)
    whole = draw_requests(smollm2_bf16, settings)
    drawn = []
    again = draw_requests(smollm2_bf16, settings, done={0: whole[0], 3: whole[3]},
                          on_draw=lambda i, d: drawn.append((i, d)))
    assert again == whole and sorted(drawn) == [(i, whole[i]) for i in (1, 2, 4)]


def test_the_draw_log_reads_back_complete_lines_only(tmp_path):
    log = magpie.DrawLog(tmp_path / "draws.jsonl")
    assert log.read() == {}
    log.append(0, Draw("first \u00e9 request", True))
    log.append(2, Draw("third", False))
    with log.path.open("a") as f:
        f.write('{"index": 3, "text": "cut sh')  # an interruption in the middle of a line
    assert log.read() == {0: Draw("first \u00e9 request", True), 2: Draw("third", False)}
    log.append(3, Draw("fourth", True))  # starts on its own line after the cut one
    assert log.read() == {0: Draw("first \u00e9 request", True), 2: Draw("third", False), 3: Draw("fourth", True)}
    log.remove()
    assert not log.path.exists()


def test_add_heads_resumes_an_interrupted_magpie_draw(tiny_folder, tmp_path, capsys, monkeypatch, fake_draws):
    """An add-heads run stopped while the target writes its prompts keeps each request drawn (the draw
    log in the features folder); --resume draws only the others and trains on the same prompts as an
    uninterrupted run; without --resume they are drawn again."""
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    base = ["add-heads", "-m", str(tiny_folder), "--self-distill", "--num-heads", "2", "--response-tokens", "8",
            "--epochs", "1", "--magpie-prompts", "5"]
    fake = magpie.draw_requests
    seen_done = []

    def interrupted(session, settings, on_done=None, done=None, on_draw=None):
        seen_done.append(sorted(done or {}))

        def stop_after_two(i, d):
            on_draw(i, d)
            if i == 1:
                raise KeyboardInterrupt

        return fake(session, settings, on_done, done, stop_after_two)

    monkeypatch.setattr(magpie, "draw_requests", interrupted)
    assert main([*base, "--out", str(tmp_path / "a")]) == 130 and seen_done == [[]]
    logs = list((tmp_path / "home" / "work").glob(f"features-*/{magpie.DRAW_LOG_FILE}"))
    assert len(logs) == 1 and sorted(magpie.DrawLog(logs[0]).read()) == [0, 1]
    seen = []
    monkeypatch.setattr(magpie, "draw_requests",
                        lambda s, st, on_done=None, done=None, on_draw=None: (seen.append(sorted(done or {})),
                                                                              fake(s, st, on_done, done, on_draw))[1])
    assert main([*base, "--resume", "--out", str(tmp_path / "a")]) == 0
    assert seen == [[0, 1]] and "keeping the 2 requests drawn before" in capsys.readouterr().err
    assert not logs[0].exists()  # the cache holds them now
    lines = (tmp_path / "a" / magpie.PROMPTS_FILE).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"prompt": p} for p in KEPT]
