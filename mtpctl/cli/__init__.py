"""Command-line interface: click commands only. Each parses its options, calls into
``mtpctl.convert`` / ``mtpctl.runtime``, and leaves error messages and exit codes to ``main``."""
