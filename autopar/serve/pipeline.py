"""``autopar.pipeline("text-generation", model=...)``: text in, text out, in the shape of Hugging
Face's ``pipeline`` (and MindFormers' ``pipeline(task="text_generation")``), on autopar's
:class:`~autopar.serve.generate.Generator` (its KV cache, and a plan's layout when given one).

Text is tokenized by the model's own tokenizer (its Hugging Face folder, or ``tokenizer=``);
a conversation (a list of ``{"role", "content"}`` messages) goes through the tokenizer's chat
template with the generation prompt added. Outputs follow Hugging Face's text-generation
pipeline (transformers 5): ``[{"generated_text": ...}]`` per input, the prompt's text followed by
the new tokens' text (``return_full_text=False``: the new text alone); for a conversation, the
messages followed by ``{"role": "assistant", "content": new text}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.data.instruction import load_hf_tokenizer, tokenizer_beside
from autopar.errors import PlanError
from autopar.plan import Plan
from autopar.serve.generate import Generator

TASKS = ("text-generation",)


class TextGenerationPipeline:
    """Generates text for a string, a conversation, or a list of either (see the module)."""

    def __init__(self, generator: Generator, tokenizer: Any) -> None:
        self.generator = generator
        self.tokenizer = tokenizer

    def _prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            if not getattr(self.tokenizer, "chat_template", None):
                raise PlanError("this tokenizer has no chat template; pass the prompt as a "
                                "string instead of a list of messages")
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                     tokenize=True)
            # transformers 5 returns a BatchEncoding, 4 a list of ids
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        raise PlanError(f"a prompt is a string or a list of {{'role', 'content'}} messages; got "
                        f"{type(prompt).__name__}")

    def __call__(self, inputs: str | list, *, max_new_tokens: int = 32, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 return_full_text: bool = True, seed: int = 0) -> list:
        """``[{"generated_text": ...}]`` for one prompt; a list of those for a list of
        prompts."""
        if not isinstance(inputs, (str, list, tuple)):
            raise PlanError(f"a prompt is a string or a list of {{'role', 'content'}} "
                            f"messages; got {type(inputs).__name__}")
        single = isinstance(inputs, str) or (
            isinstance(inputs, list) and inputs and all(isinstance(m, dict) for m in inputs))
        prompts = [inputs] if single else list(inputs)
        if not prompts:
            raise PlanError("no prompt given; pass a string or a list of strings")
        ids = [self._prompt_ids(p) for p in prompts]
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        rows = self.generator.generate(ids, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                       temperature=temperature, top_k=top_k, top_p=top_p,
                                       eos_token_id=eos, pad_token_id=pad, seed=seed)
        width = max(len(p) for p in ids)
        outputs = []
        for prompt, row in zip(prompts, rows.tolist(), strict=True):
            # left padding: every row's prompt ends at ``width``
            new = self.tokenizer.decode(row[width:], skip_special_tokens=True)
            if not return_full_text:
                text: str | list = new
            elif isinstance(prompt, str):
                text = prompt + new
            else:
                text = [*prompt, {"role": "assistant", "content": new}]
            outputs.append([{"generated_text": text}])
        return outputs[0] if single else outputs


def pipeline(task: str, model: nn.Module | str | Path, *, tokenizer: Any = None,
             plan: Plan | None = None, device: str | torch.device = "cpu"
             ) -> TextGenerationPipeline:
    """A text-generation pipeline over ``model`` (what :class:`Generator` takes: a module, a
    Hugging Face folder, a shipped name or an artifact). ``tokenizer``: a loaded tokenizer or
    its folder (default: the model's folder, when it holds one). ``plan``: the layout to
    generate under, in the current process group (every rank calls the pipeline with the same
    inputs)."""
    if task not in TASKS:
        raise PlanError(f"unknown pipeline task {task!r}; autopar runs {', '.join(TASKS)}")
    if tokenizer is None:
        tokenizer = tokenizer_beside(model)
        if tokenizer is None:
            raise PlanError("no tokenizer: the model is not a folder holding one; pass "
                            "tokenizer=FOLDER")
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_hf_tokenizer(tokenizer)
    return TextGenerationPipeline(Generator(model, plan=plan, device=device), tokenizer)
