"""The front door in Hugging Face's and MindFormers' shape: :class:`Trainer` with
:class:`TrainingArguments` (plan, compile and run in a few lines), above the passes it
calls (search, codegen, train, serve)."""

from autopar.api.arguments import TrainingArguments
from autopar.api.generation import PredictionOutput
from autopar.api.trainer import Trainer, TrainOutput

__all__ = ["PredictionOutput", "TrainOutput", "Trainer", "TrainingArguments"]
