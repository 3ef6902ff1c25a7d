"""Code that reads one checkpoint and writes another: model sources, GGUF import (and, later, head
grafting, vocabulary pairing and export). Depends on ``mtpctl.runtime``, never the reverse."""
