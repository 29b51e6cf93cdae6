"""``autopar run``'s options as one record: what click parsed, passed on as a whole instead of
seventeen parameters."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import click

from autopar.train.run_flags import run_options


@dataclass(frozen=True)
class GenerationOptions:
    """``--generate``'s options: the prompts, how to decode them, how to print them."""

    prompts: str | None = None
    tokenizer: str | None = None
    max_new_tokens: int = 32
    sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | None = None

    def decoding(self, seed: int) -> dict:
        """The keyword arguments :func:`autopar.serve.generate.serve` decodes with."""
        return dict(max_new_tokens=self.max_new_tokens, do_sample=self.sample,
                    temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    eos_token_id=self.eos_token_id, seed=seed)


@dataclass(frozen=True)
class RunOptions:
    """One ``autopar run DIR ...``: the artifact, the run's length, data and seed, where it
    runs, checkpoints, and (``serving``) generation. ``training`` holds the training options'
    values as :func:`autopar.train.run_flags.training_options` names them (optimizer,
    schedule, evaluation, profiling, console, keep_last, final_save, overwrite, timeout_s)."""

    directory: str
    steps: int = 10
    data: str = "synthetic"
    seed: int = 0
    device: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    init_from: str | None = None
    serving: bool = False
    generation: GenerationOptions = field(default_factory=GenerationOptions)
    training: dict = field(default_factory=dict)

    @property
    def timeout_s(self) -> int:
        """Seconds a collective may wait for its peers (``--timeout``)."""
        return int(self.training.get("timeout_s", 600))

    @classmethod
    def from_click(cls, params: dict) -> RunOptions:
        """The record of ``autopar run``'s parsed parameters (click's keyword names): the
        run's own and generation's fields, the rest as ``training``."""
        params = dict(params)
        generation = GenerationOptions(**{name: params.pop(name)
                                          for name in GenerationOptions.__dataclass_fields__
                                          if name in params})
        own = {name: params.pop(name) for name in cls.__dataclass_fields__
               if name in params and name not in ("generation", "training")}
        return cls(**own, generation=generation, training=params)

    @classmethod
    def from_argv(cls, program: str, argv: list[str] | None = None) -> RunOptions:
        """The record for a generated program run as a script (``torchrun DIR/train.py
        --steps 100 ...``): the artifact is the program's directory, ``argv`` (default: the
        script's) takes ``autopar run``'s options. A bad option raises click's UsageError."""
        argv = sys.argv[1:] if argv is None else argv
        directory = os.path.dirname(os.path.abspath(program))
        command = click.command("run")(run_options(lambda **params: params))
        context = command.make_context(os.path.basename(program), [directory, *argv])
        return cls.from_click(context.params)
