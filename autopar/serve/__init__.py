"""Serving a trained run: cached generation (``autopar.Generator``), its ONNX export and the
export of a run's weights to a Hugging Face folder."""
