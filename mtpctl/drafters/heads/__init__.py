"""MTP heads: Medusa and Hydra heads (:mod:`~mtpctl.drafters.heads.medusa`), the EAGLE layer
(:mod:`~mtpctl.drafters.heads.eagle`), their static draft trees (:mod:`~mtpctl.drafters.heads.tree`),
and the head folder (:mod:`~mtpctl.drafters.heads.config`, :mod:`~mtpctl.drafters.heads.folder`)."""
