"""mtpctl: multi-token prediction heads and speculative decoding for LLMs.

Layers (dependencies point one way): ``mtpctl.cli`` -> ``mtpctl.convert`` -> ``mtpctl.runtime``.
"""

__version__ = "0.1.0"
