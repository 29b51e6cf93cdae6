"""Hugging Face's generation names for :func:`autopar.pipeline`: which a call may pass, what
they resolve to, and which are refused.

A setting is looked up, first found wins, in: the call's keywords, its ``generation_config``
(a ``transformers.GenerationConfig`` or a dict of its fields), the model folder's
``generation_config.json``, then the defaults. The defaults are Hugging Face's text-generation
pipeline's (a sampled call draws with temperature 0.7 and top-k 50 unless something sets them),
except two: autopar decodes greedily and adds 32 tokens unless told otherwise (Hugging Face
samples 256).

The length is ``max_new_tokens``, or ``max_length``: as in Hugging Face's pipeline, which runs
each prompt alone, a cap on each prompt's tokens plus its new ones. A source that sets both
means ``max_new_tokens`` (Hugging Face's rule); a higher source's ``max_length`` still beats a
lower one's ``max_new_tokens``.

A generation setting autopar does not implement (beam search, repetition penalties, several
sequences per prompt, ...) is refused in one line naming it and where it came from, unless it
holds its off value (``num_beams=1``); nothing is silently ignored.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.errors import PlanError

# what a call (or a generation config) may set, and what autopar does with it
GENERATION_NAMES = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k",
                    "top_p", "eos_token_id", "pad_token_id")
OUTPUT_NAMES = ("return_full_text", "return_tensors", "seed")
CALL_NAMES = (*GENERATION_NAMES, *OUTPUT_NAMES, "generation_config")

AUTOPAR_DEFAULTS = {"max_new_tokens": 32, "do_sample": False}
# Hugging Face's, where a sampled call sets none: its pipeline's temperature, generate's top-k
SAMPLING_DEFAULTS = {"temperature": 0.7, "top_k": 50, "top_p": 1.0}

# generation-config fields that do not change which tokens come out (bookkeeping, caching,
# what generate returns besides the tokens, settings that need beams or an assistant model)
NO_EFFECT = frozenset({
    "bos_token_id", "transformers_version", "use_cache", "cache_implementation", "cache_config",
    "compile_config", "disable_compile", "prefill_chunk_size", "low_memory", "max_cache_len",
    "output_attentions", "output_hidden_states", "output_scores", "output_logits",
    "return_dict_in_generate", "decoder_start_token_id", "is_assistant", "early_stopping",
    "length_penalty", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
    "assistant_early_exit", "assistant_ensemble_weight", "speculation_type", "use_mtp",
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "continuous_batching_config"})

# values of settings autopar does not implement that mean "off" (Hugging Face's defaults)
OFF_VALUES = {"num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1,
              "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
              "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "min_length": 0,
              "min_new_tokens": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
              "diversity_penalty": 0.0, "remove_invalid_values": False,
              "renormalize_logits": False, "token_healing": False, "guidance_scale": 1.0,
              "min_p": 0.0, "top_h": 1.0, "penalty_alpha": 0.0}

# Hugging Face text-generation pipeline options (not generation settings) autopar lacks
HF_PIPELINE_OPTIONS = frozenset({
    "return_text", "return_type", "clean_up_tokenization_spaces", "prefix",
    "handle_long_generation", "stop_sequence", "truncation", "continue_final_message",
    "skip_special_tokens", "tokenizer_encode_kwargs", "tools", "documents", "add_special_tokens",
    "padding", "batch_size", "num_workers", "assistant_model", "assistant_tokenizer"})

WHAT_AUTOPAR_DECODES = ("autopar decodes greedily, or samples with temperature, top_k and "
                        "top_p (do_sample=True)")


@dataclass(frozen=True)
class Decoding:
    """One call's generation settings, resolved (see the module)."""

    max_new_tokens: int | None  # exactly one of these two is set
    max_length: int | None
    do_sample: bool
    temperature: float
    top_k: int | None  # None: every token stays
    top_p: float | None
    stop_ids: tuple[int, ...]  # a row ends at the first of these
    pad_token_id: int | None

    def new_token_limits(self, prompt_lengths: Sequence[int]) -> list[int]:
        """How many new tokens each prompt may get: ``max_new_tokens``, or ``max_length``
        less the prompt's own length (Hugging Face's pipeline runs each prompt alone)."""
        if self.max_new_tokens is not None:
            return [self.max_new_tokens for _ in prompt_lengths]
        longest = max(prompt_lengths)
        if longest >= self.max_length:
            raise PlanError(f"max_length={self.max_length} caps a prompt's tokens plus its new "
                            f"ones, and a prompt already has {longest} tokens; raise "
                            f"max_length or pass max_new_tokens")
        return [self.max_length - n for n in prompt_lengths]

    def generator_kwargs(self, max_new_tokens: int, seed: int) -> dict:
        """The keywords :meth:`autopar.Generator.generate` takes for these settings. The
        Generator stops rows at one id; a row that ends at another stop id is cut after the
        fact (:meth:`cut`)."""
        eos = self.stop_ids[0] if self.stop_ids else None
        return dict(max_new_tokens=max_new_tokens, do_sample=self.do_sample,
                    temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    eos_token_id=eos, pad_token_id=self.pad_token_id, seed=seed)

    def cut(self, new: list[int], limit: int) -> list[int]:
        """A row's new ids as Hugging Face's pipeline returns them for the prompt alone: at
        most ``limit``, ending at the first stop id."""
        new = new[:limit]
        ends = [new.index(i) for i in self.stop_ids if i in new]
        return new[:min(ends) + 1] if ends else new


def split_call(options: dict) -> tuple[dict, dict]:
    """(generation settings, output options) of a call's keywords. A name that is neither
    autopar's nor a Hugging Face generation setting is refused here in one line, never as a
    TypeError; Hugging Face's settings are checked once resolved (:func:`resolve`)."""
    generation, output = {}, {}
    for name, value in options.items():
        if name in OUTPUT_NAMES:
            output[name] = value
        else:
            check_name(name, "")
            generation[name] = value
    return generation, output


def check_name(name: str, origin: str) -> None:
    """Refuse a name autopar.pipeline does not take at all, in one line (``origin``: where it
    was read; empty: the call)."""
    where = f" (in {origin})" if origin else ""
    if name in CALL_NAMES or name in hf_generation_fields():
        return
    if name in HF_PIPELINE_OPTIONS:
        raise PlanError(f"{name} is a Hugging Face pipeline option autopar.pipeline does not "
                        f"implement{where}; it accepts {', '.join(CALL_NAMES)}")
    raise PlanError(f"unknown keyword {name!r}{where}; autopar.pipeline accepts "
                    f"{', '.join(CALL_NAMES)}")


def refuse_setting(name: str, value: object, origin: str) -> None:
    """Refuse, in one line naming it and ``origin``, a Hugging Face generation setting
    autopar does not implement; return when it holds its off value or does not change the
    tokens."""
    if name in NO_EFFECT or value is None or (name in OFF_VALUES and value == OFF_VALUES[name]):
        return
    where = f" (from {origin})" if origin else ""
    off = f", or pass {name}={OFF_VALUES[name]!r}" if name in OFF_VALUES else ""
    raise PlanError(f"{name}={value!r}{where} is not in autopar: {WHAT_AUTOPAR_DECODES}; drop "
                    f"it{off}")


@functools.cache
def hf_generation_fields() -> frozenset[str]:
    """The field names of transformers' GenerationConfig (the installed version's)."""
    from transformers import GenerationConfig

    return frozenset(k for k in vars(GenerationConfig()) if not k.startswith("_"))


def config_fields(config: object, origin: str) -> dict:
    """The settings a generation config sets: a GenerationConfig's, or a dict of its fields
    (a name it does not have is refused)."""
    from transformers import GenerationConfig

    if isinstance(config, GenerationConfig):
        fields = config.to_diff_dict()
    elif isinstance(config, dict):
        fields = dict(config)
    else:
        raise PlanError(f"generation_config is a transformers.GenerationConfig or a dict of "
                        f"its fields, got {type(config).__name__}")
    fields = {k: v for k, v in fields.items() if not str(k).startswith("_")}
    for name in fields:
        check_name(name, origin)
    return fields


def folder_defaults(model: object) -> tuple[dict, str]:
    """(the settings of the model folder's ``generation_config.json``, its path); no settings
    for anything but a folder holding one."""
    if not isinstance(model, (str, Path)):
        return {}, ""
    path = Path(model) / "generation_config.json"
    if not path.is_file():
        return {}, ""
    try:
        fields = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {path}: {' '.join(str(exc).split())}; fix the JSON or "
                        f"delete the file") from None
    return config_fields(fields, str(path)), str(path)


def resolve(call: dict, folder: tuple[dict, str], tokenizer: Any) -> Decoding:
    """The settings of one call: its keywords (``call``) over its ``generation_config`` over
    the folder's ``generation_config.json`` (``folder``: its settings and path, from
    :func:`folder_defaults`) over the defaults; eos and pad from the tokenizer when nothing
    sets them."""
    call = dict(call)
    if call.get("max_new_tokens") is not None and call.get("max_length") is not None:
        raise PlanError("pass max_new_tokens or max_length, not both (max_length caps a "
                        "prompt's tokens plus its new ones)")
    given = call.pop("generation_config", None)
    sources = [(call, ""),
               (config_fields(given, "generation_config") if given is not None else {},
                "generation_config"), folder]
    _refuse_unimplemented(sources)
    layers = [{k: v for k, v in fields.items() if v is not None} for fields, _ in sources]
    setting = _first_found(layers)
    new, total = _length(layers)
    do_sample = setting("do_sample", AUTOPAR_DEFAULTS["do_sample"])
    if not isinstance(do_sample, bool):
        raise PlanError(f"do_sample is True or False, got {do_sample!r}")
    stop = _stop_ids(setting("eos_token_id", tokenizer.eos_token_id))
    pad = setting("pad_token_id", tokenizer.pad_token_id)
    decoding = Decoding(
        max_new_tokens=new, max_length=total, do_sample=do_sample,
        temperature=_number("temperature", setting("temperature",
                                                   SAMPLING_DEFAULTS["temperature"])),
        top_k=_top_k(setting("top_k", SAMPLING_DEFAULTS["top_k"])),
        top_p=_top_p(_number("top_p", setting("top_p", SAMPLING_DEFAULTS["top_p"]))),
        stop_ids=stop, pad_token_id=pad if pad is not None else (stop[0] if stop else None))
    _check(decoding)
    return decoding


def _refuse_unimplemented(sources: list[tuple[dict, str]]) -> None:
    """Each setting autopar does not implement, as the first source that sets it says: a
    call's ``num_beams=1`` lets a folder's ``num_beams: 4`` go, as a call's keyword wins."""
    names = {n for fields, _ in sources for n in fields if n not in GENERATION_NAMES}
    for name in sorted(names):
        value, origin = next(((fields[name], origin) for fields, origin in sources
                              if fields.get(name) is not None), (None, ""))
        refuse_setting(name, value, origin)


def _first_found(layers: list[dict]):
    def setting(name: str, default: object) -> object:
        for layer in layers:
            if layer.get(name) is not None:
                return layer[name]
        return default

    return setting


def _length(layers: list[dict]) -> tuple[int | None, int | None]:
    """(max_new_tokens, max_length): the first source that sets either decides; within one,
    max_new_tokens wins, as in Hugging Face's generate."""
    for layer in layers:
        if layer.get("max_new_tokens") is not None:
            return _positive_int("max_new_tokens", layer["max_new_tokens"]), None
        if layer.get("max_length") is not None:
            return None, _positive_int("max_length", layer["max_length"])
    return AUTOPAR_DEFAULTS["max_new_tokens"], None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")
    return value


def _stop_ids(value: object) -> tuple[int, ...]:
    """eos_token_id as Hugging Face takes it: one id, or a list of ids any of which ends a
    row."""
    ids = [value] if isinstance(value, int) else list(value) if isinstance(
        value, (list, tuple)) else None
    if value is None:
        return ()
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                              for i in ids):
        raise PlanError(f"eos_token_id is a token id or a list of them, got {value!r}")
    return tuple(ids)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{name} is a number, got {value!r}")
    return float(value)


def _top_k(value: object) -> object:
    # Hugging Face's top_k=0 keeps every token (it adds no top-k warper): autopar's None
    return None if value == 0 and not isinstance(value, bool) else value


def _top_p(value: float) -> float | None:
    return None if value == 1.0 else value  # 1.0 keeps every token, as None does


def _check(d: Decoding) -> None:
    """Refuse values that cannot run, in one line each (what Generator.generate checks too,
    said here before any prompt is tokenized)."""
    if d.do_sample and d.temperature <= 0:
        raise PlanError(f"temperature must be positive, got {d.temperature}; use "
                        f"do_sample=False for greedy decoding")
    if d.top_k is not None and (isinstance(d.top_k, bool) or not isinstance(d.top_k, int)
                                or d.top_k < 1):
        raise PlanError(f"top_k must be a positive integer (0: keep every token), got "
                        f"{d.top_k!r}")
    if d.top_p is not None and not 0 < d.top_p <= 1:
        raise PlanError(f"top_p must be in (0, 1], got {d.top_p}")
