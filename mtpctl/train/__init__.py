"""Training MTP heads: data and self-distillation (:mod:`~mtpctl.train.distill`), the target's cached
features (:mod:`~mtpctl.train.features`), the trainers (:mod:`~mtpctl.train.trainer`,
:mod:`~mtpctl.train.eagle`), and the ``add-heads`` pipeline (:mod:`~mtpctl.train.add_heads`)."""
