"""Decode-time code: decoder model, KV cache, drafters, acceptance, sampling, the decoding loop.

Nothing here imports click, ``mtpctl.convert`` or an optional heavy package at import time.
"""
