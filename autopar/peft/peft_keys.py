"""Hugging Face ``peft`` settings that autopar does not implement: accepted where they are
switched off, refused in one line where they are on.

Dropping such a setting silently would train something other than what the user asked for
(DoRA's magnitude vectors, per-layer ranks, extra fully trained modules) while reporting
success, so a setting is either one autopar runs, one that cannot change what trains
(bookkeeping such as ``base_model_name_or_path``, shapes peft fills in from the model), or
off. peft adds settings in new releases, each off by default, so a key in peft's own
``adapter_config.json`` that autopar has never heard of is accepted only while it is off too.
"""

from __future__ import annotations

import json

from autopar.errors import PlanError

# what each method takes (autopar.peft.config.PeftConfig's fields), for the error's fix
METHOD_SETTINGS = {
    "lora": ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora"),
    "prefix_tuning": ("num_virtual_tokens",),
    "adapter": ("adapter_size",),
    "low_rank_adapter": ("adapter_size", "low_rank_rank"),
    "bitfit": (),
    "rdrop": ("rdrop_alpha", "dropout"),
}

# bookkeeping peft writes beside the settings; none changes what trains
_RECORDS = frozenset({"task_type", "auto_mapping", "peft_version", "base_model_name_or_path",
                      "revision", "inference_mode", "megatron_core", "runtime_config"})
# shapes peft fills in from the base model (prefix tuning) or a weight-layout flag (GPT-2's
# Conv1D); autopar reads them from the model itself
_FROM_MODEL = frozenset({"token_dim", "num_transformer_submodules", "num_attention_heads",
                         "num_layers", "encoder_hidden_size", "fan_in_fan_out"})
# only read together with a switch that must be off (use_qalora)
_DEPENDENT = frozenset({"qalora_group_size"})

# peft's settings autopar does not implement, and the values that leave them off
_OFF: dict[str, tuple] = {
    "use_dora": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "modules_to_save": (None, []),
    "layers_to_transform": (None, []),
    "layers_pattern": (None, [], ""),
    "layer_replication": (None, []),
    "exclude_modules": (None, [], ""),
    "bias": ("none",),
    "init_lora_weights": (True,),
    "init_weights": (None, True),
    "loftq_config": ({}, None),
    "lora_bias": (False,),
    "use_qalora": (False,),
    "megatron_config": (None,),
    "trainable_token_indices": (None,),
    "target_parameters": (None, []),
}
_GENERIC_OFF = (None, False, {}, [], "")


def _is(value: object, choices: tuple) -> bool:
    # bool is an int in Python: False must not match 0, nor True 1
    return any(type(value) is type(c) and value == c for c in choices)


def _short(value: object) -> str:
    text = json.dumps(value, default=str)  # JSON's words (false, null) read right in YAML too
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse(where: str, key: str, value: object, method: str, fix: str) -> PlanError:
    settings = ", ".join(METHOD_SETTINGS.get(method, ())) or "no settings"
    return PlanError(f"{where}: peft setting {key}={_short(value)} is not implemented in "
                     f"autopar; {fix}; autopar's {method} takes {settings}")


def drop_switched_off(data: dict, where: str, method: str, known: frozenset[str] | set[str],
                      peft_file: bool) -> dict:
    """``data`` without the peft settings that are off (or bookkeeping); a
    :class:`PlanError` naming the first one that is on, and what ``method`` takes instead.

    ``known``: the settings autopar runs (kept for the caller). Bookkeeping
    (``base_model_name_or_path``, ...) is dropped from any source. ``peft_file``: ``data`` is
    peft's own ``adapter_config.json``, whose model-derived entries are accepted and whose
    other unknown keys are accepted while off; elsewhere unknown keys are kept for the
    caller's unknown-setting check (a typo, not a peft feature).
    """
    kept = {}
    for key, value in data.items():
        if key in known:
            kept[key] = value
        elif key in _OFF:
            if not _is(value, _OFF[key]):
                off = " or ".join(json.dumps(v) for v in _OFF[key])
                raise _refuse(where, key, value, method, f"remove it (or set it to {off})")
        elif key in _RECORDS:  # bookkeeping, from any source (an export's adapter config)
            continue
        elif not peft_file:
            kept[key] = value
        elif key in _FROM_MODEL or key in _DEPENDENT:
            continue
        elif not _is(value, _GENERIC_OFF):
            raise _refuse(where, key, value, method, "remove it from the file")
    return kept


__all__ = ["METHOD_SETTINGS", "drop_switched_off"]
