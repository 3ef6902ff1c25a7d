"""Export for deployment: the fused draft/verify graph as ONNX (:mod:`~mtpctl.export.onnx`), a
TensorRT engine built from it (:mod:`~mtpctl.export.tensorrt`), and MTP heads in serving engines'
checkpoint layouts (:mod:`~mtpctl.export.serving`, over :mod:`~mtpctl.export.medusa_layouts` and
:mod:`~mtpctl.export.eagle_layouts`), with the way back for heads published in those layouts
(:mod:`~mtpctl.export.imports`); every output folder is written atomically
(:func:`mtpctl.files.output_folder`)."""
