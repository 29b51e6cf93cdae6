"""peft settings autopar does not implement are refused in one line, never dropped; the same
settings switched off (peft's defaults) are accepted."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.peft import parse_peft

from ..cli.test_inspect import _assert_one_line_error, cli_here


@pytest.mark.parametrize(("setting", "key"), [
    ({"use_dora": True}, "use_dora"),
    ({"rank_pattern": {"q_proj": 16}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 32}}, "alpha_pattern"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"layers_to_transform": [0, 1]}, "layers_to_transform"),
    ({"bias": "all"}, "bias"),
    ({"init_lora_weights": "gaussian"}, "init_lora_weights"),
    ({"lora_bias": True}, "lora_bias"),
])
def test_peft_files_with_unimplemented_settings_are_refused(tmp_path, setting, key) -> None:
    from peft import LoraConfig

    LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **setting).save_pretrained(tmp_path)
    with pytest.raises(autopar.PlanError) as caught:
        parse_peft(tmp_path / "adapter_config.json")
    message = str(caught.value)
    assert "\n" not in message
    assert f"peft setting {key}=" in message and "not implemented in autopar" in message
    assert "autopar's lora takes r, lora_alpha, lora_dropout, target_modules" in message


def test_peft_files_as_peft_writes_them_are_accepted(tmp_path) -> None:
    """Every key of a default LoraConfig / PrefixTuningConfig from the installed peft (its
    off switches, bookkeeping, model shapes) loads."""
    from peft import LoraConfig, PrefixTuningConfig

    LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"], task_type="CAUSAL_LM",
               use_dora=False, rank_pattern={}).save_pretrained(tmp_path / "lora")
    config = parse_peft(tmp_path / "lora" / "adapter_config.json")
    assert (config.method, config.r, config.lora_alpha) == ("lora", 4, 16)
    PrefixTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM").save_pretrained(
        tmp_path / "prefix")
    assert parse_peft(tmp_path / "prefix" / "adapter_config.json").num_virtual_tokens == 3


def test_a_peft_key_autopar_has_never_heard_of_is_refused_while_on(tmp_path) -> None:
    from peft import LoraConfig

    LoraConfig(r=4, target_modules=["q_proj"]).save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "some_future_switch": None}))
    assert parse_peft(path).r == 4  # a new peft release's setting, off
    path.write_text(json.dumps({**data, "some_future_switch": {"on": 1}}))
    with pytest.raises(autopar.PlanError, match="peft setting some_future_switch="):
        parse_peft(path)


def test_settings_given_inline_follow_the_same_rule() -> None:
    assert parse_peft("method=lora,r=2,use_dora=false,rank_pattern={}").r == 2
    assert parse_peft({"method": "lora", "modules_to_save": None}).method == "lora"
    with pytest.raises(autopar.PlanError, match="use_dora=true is not implemented"):
        parse_peft("method=lora,use_dora=true")
    with pytest.raises(autopar.PlanError, match="unknown setting 'rnak'"):
        parse_peft("method=lora,rnak=4")  # a typo is still a typo, not a peft feature


def test_compile_refuses_an_unimplemented_peft_setting_in_one_line(tmp_path) -> None:
    from peft import LoraConfig

    LoraConfig(r=4, target_modules=["q_proj"], use_dora=True).save_pretrained(tmp_path)
    out = tmp_path / "art"
    _assert_one_line_error(cli_here("compile", "tiny-llama", "--devices", "1", "--task",
                                    "finetune", "--peft", str(tmp_path / "adapter_config.json"),
                                    "--out", str(out)), "use_dora=true", "autopar's lora takes")
    assert not out.exists()
    _assert_one_line_error(cli_here("compile", "tiny-llama", "--devices", "1", "--task",
                                    "finetune", "--peft", "method=lora,modules_to_save=[lm_head]",
                                    "--out", str(out)), "modules_to_save")
    assert not out.exists()
