"""Loading a checkpoint's tokenizer never runs the checkpoint's own code nor asks on the terminal."""

from __future__ import annotations

import json
import shutil

from mtpctl.model.tokenizer import TextCodec


def test_a_config_naming_its_own_class_loads_without_asking(tiny_folder, tmp_path, capfd):
    """Released MiMo's config.json names a config class in its own Python file (``auto_map``); transformers
    asks "Do you wish to run the custom code?" unless told not to run it."""
    folder = tmp_path / "remote"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mimo", auto_map={"AutoConfig": "configuration_mimo.MiMoConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_mimo.py").write_text("raise RuntimeError(\"the checkpoint code ran\")\n")
    ids = TextCodec(folder).encode_prompt("hello there")
    out, err = capfd.readouterr()
    assert "Do you wish" not in out + err and "code ran" not in out + err
    assert ids == TextCodec(tiny_folder).encode_prompt("hello there")
