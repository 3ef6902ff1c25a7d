"""``python -m mtpctl`` runs the CLI."""

from mtpctl.cli.main import entry

entry()
