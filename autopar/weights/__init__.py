"""Hugging Face checkpoints: where each tensor lives in one (``hf_layout``), reading a rank's
slices of it (``hf_weights``), and what an export carries over from the folder a run started
from (``base_files``)."""
