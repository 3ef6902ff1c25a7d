"""Decoding, backend-free: the draft tree (:mod:`~mtpctl.decode.tree`), who attends to whom
(:mod:`~mtpctl.decode.attention`), the engine and drafter contracts (:mod:`~mtpctl.decode.engine`,
:mod:`~mtpctl.decode.drafter`), the loop (:mod:`~mtpctl.decode.loop`), acceptance, sampling,
stopping, and the session every backend's generate goes through (:mod:`~mtpctl.decode.session`)."""
