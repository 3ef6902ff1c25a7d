"""The target model: its config (:mod:`~mtpctl.model.config`), strict safetensors weights, the
decoder (:mod:`~mtpctl.model.decoder`), packed and blocked linear layers, the native kernels
(:mod:`~mtpctl.model.native`, ``csrc/``), the KV cache, the tokenizer and chat template, and where
models come from (:mod:`~mtpctl.model.sources`: aliases, GGUF import, hub ids)."""
