"""docs/cli.md is the commands' own help: regenerate it with
``.venv/bin/python -m mtpctl.cli.reference > docs/cli.md`` when an option changes."""

from pathlib import Path

from mtpctl.cli.reference import reference

CLI_MD = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_docs_cli_md_matches_the_commands_help():
    assert CLI_MD.read_text(encoding="utf-8") == reference(), \
        "docs/cli.md is out of date: .venv/bin/python -m mtpctl.cli.reference > docs/cli.md"


def test_every_command_and_option_is_in_the_reference():
    import click

    from mtpctl.cli.main import cli

    text = reference()
    for name, command in cli.commands.items():
        assert f"## mtpctl {name}" in text
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.opts[-1] in text, f"{name} {param.opts}"
