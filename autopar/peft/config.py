"""What a parameter-efficient fine-tuning method trains, in Hugging Face ``peft``'s words where
peft has the concept (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
``use_rslora``, ``num_virtual_tokens``); MindPet's methods peft lacks (Adapter,
LowRankAdapter, BitFit, R-Drop) take the names of their papers."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

from autopar.errors import PlanError
from autopar.peft.peft_keys import drop_switched_off

METHODS = ("lora", "prefix_tuning", "adapter", "low_rank_adapter", "bitfit", "rdrop")
# peft's adapter_config.json names its method in peft_type
_PEFT_TYPES = {"LORA": "lora", "PREFIX_TUNING": "prefix_tuning"}


@dataclass(frozen=True)
class PeftConfig:
    """One fine-tuning method and its settings (defaults: peft's, else the method's paper)."""

    method: str
    # LoRA (Hu et al. 2021): a rank-r update B @ A beside each target linear, scaled by
    # lora_alpha / r (rsLoRA, Kalajdzievski 2023: lora_alpha / sqrt(r))
    r: int = 8
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] | str | None = None  # names, a regex, or "all-linear"
    use_rslora: bool = False
    # Prefix Tuning (Li & Liang 2021): per-layer key/value prefixes of num_virtual_tokens
    num_virtual_tokens: int = 20
    # Adapter (Houlsby et al. 2019) and LowRankAdapter (Compacter, Mahabadi et al. 2021):
    # a bottleneck of adapter_size after attention and after the MLP
    adapter_size: int = 64
    low_rank_rank: int = 1  # LowRankAdapter: the rank of each bottleneck factor
    # R-Drop (Liang et al. 2021): two dropout passes, and alpha times their symmetric KL
    rdrop_alpha: float = 4.0
    dropout: float = 0.1  # R-Drop's dropout, applied where the model has none

    def to_dict(self) -> dict:
        d = asdict(self)
        if isinstance(d["target_modules"], tuple):
            d["target_modules"] = list(d["target_modules"])
        return d

    @property
    def scaling(self) -> float:
        """LoRA's scale of B @ A."""
        return self.lora_alpha / (self.r ** 0.5 if self.use_rslora else self.r)


_NAMES = {f.name for f in fields(PeftConfig)}


def parse_peft(spec: PeftConfig | dict | str | Path | None) -> PeftConfig | None:
    """A PeftConfig from a dict, a method name (``"lora"``), ``k=v`` pairs
    (``"method=lora,r=16"``), or a JSON/YAML file (peft's ``adapter_config.json`` included)."""
    if spec is None or isinstance(spec, PeftConfig):
        return spec
    where = "peft"
    if isinstance(spec, (str, Path)):
        text = str(spec)
        path = Path(text)
        if path.is_file():
            where = str(path)
            try:
                data = json.loads(path.read_text()) if path.suffix == ".json" else \
                    yaml.safe_load(path.read_text())
            except (ValueError, yaml.YAMLError) as exc:
                raise PlanError(f"cannot read {path} ({' '.join(str(exc).split())}); pass "
                                f"peft's adapter_config.json or a YAML of the settings") \
                    from None
        elif "=" in text:
            data = {}
            for item in text.split(","):
                key, _, value = item.partition("=")
                data[key.strip()] = yaml.safe_load(value.strip())
        else:
            data = {"method": text}
    else:
        data = dict(spec)
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a mapping of settings")
    peft_file = "peft_type" in data
    if peft_file:  # peft's adapter_config.json
        kind = str(data.pop("peft_type")).upper()
        if kind not in _PEFT_TYPES:
            raise PlanError(f"{where}: peft_type {kind} is not one autopar runs; use "
                            f"{', '.join(_PEFT_TYPES)}")
        if data.get("prefix_projection"):
            raise PlanError(f"{where}: prefix_projection (an MLP that makes the prefix) is not "
                            f"in autopar; use a prefix tuning config without it")
        data["method"] = _PEFT_TYPES[kind]
    method = str(data.get("method", "")).lower().replace("-", "_")
    if method not in METHODS:
        raise PlanError(f"{where}: unknown fine-tuning method {data.get('method')!r}; use one "
                        f"of {', '.join(METHODS)}")
    # peft's settings autopar does not run: refused when on, never silently dropped
    data = drop_switched_off(data, where, method, _NAMES, peft_file=peft_file)
    unknown = sorted(set(data) - _NAMES)
    if unknown:
        raise PlanError(f"{where}: unknown setting {unknown[0]!r}; use "
                        f"{', '.join(sorted(_NAMES - {'method'}))}")
    data["method"] = method
    targets = data.get("target_modules")
    if isinstance(targets, list):
        data["target_modules"] = tuple(targets)
    config = PeftConfig(**data)
    for name in ("r", "num_virtual_tokens", "adapter_size", "low_rank_rank"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"{where}: {name} must be a positive integer, got {value!r}")
    for name in ("lora_dropout", "dropout"):
        if not 0 <= float(getattr(config, name)) < 1:
            raise PlanError(f"{where}: {name} must be in [0, 1), got {getattr(config, name)}")
    return config


__all__ = ["METHODS", "PeftConfig", "parse_peft"]
