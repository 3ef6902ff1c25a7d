"""docs/cli.md, generated from the commands' own ``--help``: their usage, text, options and examples.

    .venv/bin/python -m mtpctl.cli.reference > docs/cli.md

(tests/test_cli_docs.py fails when the file and the commands drift apart.)
"""

from __future__ import annotations

from typing import Iterator, List, Tuple

import click

from mtpctl.cli.main import cli


def _commands(group: click.Group, prefix: str) -> Iterator[Tuple[str, click.Command]]:
    for name in group.list_commands(click.Context(group)):
        command = group.get_command(click.Context(group), name)
        if isinstance(command, click.Group):
            yield f"{prefix} {name}", command
            yield from _commands(command, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", command


def _text(text: str) -> List[str]:
    """A help text or epilog as markdown: ``\\b`` blocks as code blocks, paragraphs as they are."""
    out: List[str] = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        if lines[0].strip() == "\b":
            body = [line for line in lines[1:]]
            title = body[0].strip() if body and body[0].strip().endswith(":") else None
            body = body[1:] if title else body
            out += ([f"{title}", ""] if title else []) + ["```"] + [line.rstrip() for line in body] + ["```", ""]
        else:
            out += [" ".join(line.strip() for line in lines), ""]
    return out


def _default(param: click.Parameter) -> str:
    if isinstance(param, click.Option) and (param.is_flag or param.multiple):
        return ""
    value = param.default
    if value is None or callable(value) or type(value).__name__ == "Sentinel":  # click's UNSET: no default
        return ""
    return f"`{value}`".replace("|", "\\|")


def _options(command: click.Command, ctx: click.Context) -> List[str]:
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for param in command.params:
        if isinstance(param, click.Argument):
            rows.append(f"| `{param.human_readable_name}` | | argument |")
            continue
        names = ", ".join(param.opts + param.secondary_opts)
        kind = param.make_metavar(ctx) if not param.is_flag else ""
        meaning = " ".join((param.help or "").split()).replace("|", "\\|")
        option = f"{names} {kind}".strip().replace("|", "\\|")  # a | inside a table cell ends it, code or not
        rows.append(f"| `{option}` | {_default(param)} | {meaning} |".replace("``", ""))
    return rows + [""]


def reference() -> str:
    """The whole of docs/cli.md."""
    lines = ["# Command-line reference", "",
             "Generated from the commands' `--help` (`.venv/bin/python -m mtpctl.cli.reference > docs/cli.md`); "
             "`mtpctl COMMAND --help` prints the same.", "", "## mtpctl", "", "```",
             cli.get_usage(click.Context(cli, info_name="mtpctl")), "```", ""]
    lines += _text(cli.help or "") + _text(cli.epilog or "")
    for name, command in _commands(cli, "mtpctl"):
        ctx = click.Context(command, info_name=name)
        lines += [f"## {name}", "", "```", command.get_usage(ctx).replace("Usage: ", "Usage: "), "```", ""]
        lines += _text(command.help or "")
        if not isinstance(command, click.Group):
            lines += _options(command, ctx)
        lines += _text(command.epilog or "")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    click.echo(reference(), nl=False)
