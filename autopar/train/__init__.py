"""Training: the Trainer (the loop ``autopar run`` runs), its loss, optimizer settings, logs,
checkpoints and held-out evaluation; the launcher of ``autopar run``; and
``autopar.parallelize`` for your own loop. Above codegen: it runs the program codegen writes."""

from autopar.train.trainer import Trainer

__all__ = ["Trainer"]
