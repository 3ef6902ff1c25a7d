"""Drafters: the cheap proposers the target verifies. Prompt lookup (:mod:`~mtpctl.drafters.ngram`),
retrieval (:mod:`~mtpctl.drafters.retrieval`), draft models and their pairing with a target
(:mod:`~mtpctl.drafters.draft_model`, :mod:`~mtpctl.drafters.pairing`), MTP heads
(:mod:`mtpctl.drafters.heads`), several merged into one tree (:mod:`~mtpctl.drafters.merged`), and
:func:`mtpctl.drafters.build.build`, which turns a spec such as ``heads+ngram`` into one."""
