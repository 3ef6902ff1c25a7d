"""Command-line interface: click only. Each command module parses its options (the shared bundles of
:mod:`mtpctl.cli.options`), calls the library, and prints; :mod:`mtpctl.cli.main` turns errors into
one stderr line and an exit code."""
