"""autopar.pipeline("text-generation"): greedy text equal to Hugging Face's own text-generation
pipeline, to its generate and to autopar.Generator on the same weights and tokenizer; Hugging
Face's generation names (max_length, generation_config, the folder's generation_config.json)
as Hugging Face reads them, the ones autopar lacks refused; chat messages through the
tokenizer's chat template; under 2 gloo processes with no plan given, a plan made on rank 0
and one process's text; bad inputs refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

import autopar
from autopar.errors import PlanError
from tests.fixtures.harness import run_in_group, spawn_ranks
from tests.fixtures.layouts import with_full_size_layout
from tests.fixtures.tokenizers import word_bpe

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today",
          "we read a book at night", "user: hello there assistant: hi"]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["the cat sat", "a dog ran in the park and"]


@pytest.fixture(scope="module")
def model_folder(hf_folder, tmp_path_factory):
    """Tiny Llama's Hugging Face folder (seed-0 weights) with a small BPE tokenizer saved
    beside it and a generation_config.json naming that tokenizer's special tokens, as a
    model downloaded from the Hub holds all three."""
    fast = word_bpe(CORPUS, 100)
    fast.chat_template = CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("llama-with-tokenizer") / "model"
    shutil.copytree(hf_folder("tiny-llama"), folder)
    fast.save_pretrained(folder)
    _write_generation_config(folder, bos_token_id=fast.bos_token_id,
                             eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    return folder


def _write_generation_config(folder, **fields) -> None:
    (folder / "generation_config.json").write_text(json.dumps(
        {**fields, "transformers_version": transformers.__version__}))


def test_greedy_text_equals_hugging_faces_pipeline_and_the_generator(model_folder) -> None:
    ours = autopar.pipeline("text-generation", model=model_folder)
    tok = ours.tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder).eval()
    theirs = transformers.pipeline("text-generation", model=model, tokenizer=tok,
                                   device="cpu")
    settings = dict(max_new_tokens=8, do_sample=False)
    batch = ours(PROMPTS, **settings)
    assert len(batch) == len(PROMPTS)
    for prompt, got in zip(PROMPTS, batch, strict=True):
        expected = theirs(prompt, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, **settings)
        assert got == expected
        assert got[0]["generated_text"].startswith(prompt)
        assert ours(prompt, **settings) == got  # one prompt alone: the same text
    # and the tokens are the Generator's on the same weights
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    rows = autopar.Generator(model_folder).generate(
        ids, max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    width = max(len(i) for i in ids)
    news = [tok.decode(row[width:], skip_special_tokens=True) for row in rows.tolist()]
    # random weights: some new ids lie past the small tokenizer's vocabulary and decode to ""
    assert any(news)
    for prompt, new in zip(PROMPTS, news, strict=True):
        assert ours(prompt, return_full_text=False, **settings) == [{"generated_text": new}]
        assert ours(prompt, **settings)[0]["generated_text"] == prompt + new


def test_a_conversation_goes_through_the_chat_template(model_folder) -> None:
    ours = autopar.pipeline("text-generation", model=model_folder)
    tok = ours.tokenizer
    chat = [{"role": "user", "content": "hello there"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == "<s>user: hello there\nassistant:"
    row = autopar.Generator(model_folder).generate([ids], max_new_tokens=6,
                                                    eos_token_id=tok.eos_token_id)[0].tolist()
    new = tok.decode(row[len(ids):], skip_special_tokens=True)
    assert ours(chat, max_new_tokens=6) == [
        {"generated_text": [*chat, {"role": "assistant", "content": new}]}]
    assert ours(chat, max_new_tokens=6, return_full_text=False) == [{"generated_text": new}]


def _hf_pipeline(folder, tok):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return transformers.pipeline("text-generation", model=model, tokenizer=tok, device="cpu")


def _until_stop(ids: list[int], stop: set[int]) -> list[int]:
    """New ids as one prompt alone gets them: up to the first stop id (a batch pads after)."""
    ends = [i for i, t in enumerate(ids) if t in stop]
    return ids[:ends[0] + 1] if ends else ids


def test_greedy_token_ids_equal_hugging_faces_generate(model_folder) -> None:
    ours = autopar.pipeline("text-generation", model=model_folder, device="cpu")
    tok = transformers.AutoTokenizer.from_pretrained(model_folder, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder).eval()
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    theirs = model.generate(**batch, max_new_tokens=8, do_sample=False,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    width = batch["input_ids"].shape[1]
    got = ours(PROMPTS, max_new_tokens=8, return_tensors=True)
    stopped = 0
    for prompt, row, record in zip(PROMPTS, theirs.tolist(), got, strict=True):
        new = _until_stop(row[width:], {tok.eos_token_id})
        stopped += new[-1] == tok.eos_token_id
        assert record == [{"generated_token_ids": tok(prompt)["input_ids"] + new}]
        text = prompt + tok.decode(new, skip_special_tokens=True)
        assert ours(prompt, max_new_tokens=8) == [{"generated_text": text}]
    assert stopped == 1  # one prompt meets the stop token, the other runs its 8 tokens


def test_max_length_caps_each_prompt_as_hugging_faces_pipeline(model_folder) -> None:
    ours = autopar.pipeline("text-generation", model=model_folder)
    theirs = _hf_pipeline(model_folder, ours.tokenizer)
    lengths = [len(ours.tokenizer(p)["input_ids"]) for p in PROMPTS]
    cap = max(lengths) + 2
    got = ours(PROMPTS, max_length=cap, return_tensors=True)
    for prompt, record in zip(PROMPTS, got, strict=True):
        assert record == theirs(prompt, max_length=cap, do_sample=False, return_tensors=True)
        assert len(record[0]["generated_token_ids"]) <= cap
        assert ours(prompt, max_length=cap) == theirs(prompt, max_length=cap, do_sample=False)
    # the short prompt gets more new tokens than the long one, as with Hugging Face's pipeline
    assert len(got[0][0]["generated_token_ids"]) == cap
    with pytest.raises(PlanError, match=f"max_length={max(lengths)} caps") as info:
        ours(PROMPTS, max_length=max(lengths))
    assert "\n" not in str(info.value)


def test_generation_config_and_the_folders_file_as_hugging_face(model_folder,
                                                                 tmp_path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    first = autopar.pipeline("text-generation", model=model_folder)(
        PROMPTS[0], max_new_tokens=4, return_tensors=True)[0]["generated_token_ids"]
    stop = first[-3]  # the prompt's second new token ends it: an eos list, as Llama 3's
    _write_generation_config(folder, eos_token_id=[stop, 3], pad_token_id=0, do_sample=False,
                             max_new_tokens=6)
    ours = autopar.pipeline("text-generation", model=folder)
    theirs = _hf_pipeline(folder, ours.tokenizer)
    config = transformers.GenerationConfig(max_new_tokens=3, do_sample=False)
    for prompt in PROMPTS:
        for settings in ({}, {"return_tensors": True}):
            assert ours(prompt, **settings) == theirs(prompt, **settings)  # the file's
        expected = theirs(prompt, generation_config=config, return_tensors=True)
        assert ours(prompt, generation_config=config, return_tensors=True) == expected
        assert ours(prompt, generation_config={"max_new_tokens": 3, "do_sample": False},
                    return_tensors=True) == expected
        # the call's keywords win over its generation_config
        assert ours(prompt, generation_config=config, max_new_tokens=5) == theirs(
            prompt, generation_config=config, max_new_tokens=5)
    ids = ours(PROMPTS[0], return_tensors=True)[0]["generated_token_ids"]
    assert ids == first[:-2] and ids[-1] == stop  # the file's eos list ended the row


@pytest.mark.parametrize("setting", [dict(num_beams=4), dict(repetition_penalty=1.2),
                                     dict(num_return_sequences=2),
                                     dict(no_repeat_ngram_size=3), dict(min_new_tokens=2)])
def test_generation_settings_autopar_lacks_are_refused(model_folder, setting) -> None:
    pipe = autopar.pipeline("text-generation", model=model_folder)
    ((name, value),) = setting.items()
    with pytest.raises(PlanError, match=f"^{name}={value} is not in autopar: autopar decodes "
                                        f"greedily, or samples") as info:
        pipe(PROMPTS[0], **setting)
    assert "\n" not in str(info.value)


def test_unknown_and_conflicting_keywords_are_refused_in_one_line(model_folder,
                                                                   tmp_path) -> None:
    pipe = autopar.pipeline("text-generation", model=model_folder)
    off = pipe(PROMPTS[0], num_beams=1, repetition_penalty=1.0, max_new_tokens=3)
    assert off == pipe(PROMPTS[0], max_new_tokens=3)  # off values are accepted
    folder = tmp_path / "penalised"
    shutil.copytree(model_folder, folder)
    _write_generation_config(folder, eos_token_id=3, repetition_penalty=1.05)
    penalised = autopar.pipeline("text-generation", model=folder)
    assert penalised(PROMPTS[0], repetition_penalty=1.0, max_new_tokens=3) == off
    cases = [
        (lambda: pipe(PROMPTS[0], max_tokens=5),
         "unknown keyword 'max_tokens'; autopar.pipeline accepts max_new_tokens, max_length"),
        (lambda: pipe(PROMPTS[0], stop_sequence="."), "stop_sequence is a Hugging Face pipeline"),
        (lambda: pipe(PROMPTS[0], generation_config={"beams": 2}),
         "unknown keyword 'beams' \\(in generation_config\\)"),
        (lambda: pipe(PROMPTS[0], generation_config={"num_beams": 2}),
         "num_beams=2 \\(from generation_config\\) is not in autopar"),
        (lambda: penalised(PROMPTS[0]), "repetition_penalty=1.05 \\(from .*generation_config"
                                        ".json\\) is not in autopar"),
        (lambda: pipe(PROMPTS[0], generation_config=42), "generation_config is a"),
        (lambda: pipe(PROMPTS[0], max_new_tokens=4, max_length=9), "not both"),
        (lambda: pipe(PROMPTS[0], max_new_tokens=0), "max_new_tokens must be a positive"),
        (lambda: pipe(PROMPTS[0], do_sample=True, temperature=0), "temperature must be"),
        (lambda: pipe(PROMPTS[0], return_tensors=True, return_full_text=False),
         "drop return_full_text"),
        (lambda: autopar.pipeline("text-generation", model=model_folder, constraints={"tp": 2}),
         "this is one"),
        (lambda: autopar.pipeline("text-generation", model=model_folder, cluster="cpu"),
         "cluster shapes the layout over several processes, and this is one"),
        (lambda: autopar.pipeline("text-generation", model=model_folder, constraints={"tp": 2},
                                  plan=object()), "not both"),
    ]
    for call, message in cases:
        with pytest.raises(PlanError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


def test_device_and_layout_choices(monkeypatch) -> None:
    from autopar.serve.pipeline import replicas_of, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device(None) == torch.device("cuda", 1)
    graph = autopar.capture("tiny-llama", seq=32)
    mixed = autopar.plan(graph, devices=4, cluster="cpu", task="infer",
                         constraints=dict(dp=2, tp=2, ep=1))
    with pytest.raises(PlanError, match="re-plan with constraints dp=1"):
        replicas_of(mixed)
    assert replicas_of(None) == 1


def _pipelines_without_a_plan(folder: str) -> list:
    """On every rank: a pipeline whose planning fails on rank 0 (every rank's error, gathered),
    then one with no plan or constraints and one pinned to tp=2; each one's plan and text."""
    import torch.distributed as dist

    try:
        autopar.pipeline("text-generation", model=folder, device="cpu", constraints={"tp": 3})
        failed = None
    except PlanError as exc:
        failed = str(exc)
    everyone: list = [None, None]
    dist.all_gather_object(everyone, failed)
    results: list = [everyone]
    for constraints in (None, {"tp": 2}):
        pipe = autopar.pipeline("text-generation", model=folder, device="cpu",
                                constraints=constraints)
        results.append((pipe.plan.devices, pipe.plan.mesh, pipe(PROMPTS, max_new_tokens=8),
                        pipe(PROMPTS, max_new_tokens=8, return_tensors=True)))
    return results


def _rank_without_a_plan(rank: int, port: int, out, world: int, folder: str) -> None:
    run_in_group(rank, port, out, world, _pipelines_without_a_plan, folder)


@pytest.mark.dist
def test_under_two_processes_the_pipeline_plans_and_gives_one_processs_text(
        model_folder) -> None:
    one = autopar.pipeline("text-generation", model=model_folder)
    assert one.plan is None
    expected = (one(PROMPTS, max_new_tokens=8), one(PROMPTS, max_new_tokens=8,
                                                     return_tensors=True))
    ((failed, free, pinned),) = spawn_ranks(_rank_without_a_plan, 2, (2, str(model_folder)),
                                            timeout_s=240)
    assert all(m is not None and "tp=3" in m and "\n" not in m for m in failed), failed
    assert failed[0] == failed[1]  # rank 0's error, in the same words on every rank
    for devices, mesh, *outputs in (free, pinned):
        assert devices == 2 and tuple(outputs) == expected  # the text and the token ids
        assert mesh["dp"] * mesh["tp"] * mesh["pp"] == 2
    # the planner's own choice for a tiny model: replicas (each serves half the prompts), or a
    # split; pinned, the split is tensor parallelism
    assert pinned[1]["tp"] == 2


def _pipeline_under(folder: str, plan_dict: dict) -> list:
    from autopar.plan import Plan

    pipe = autopar.pipeline("text-generation", model=folder, plan=Plan.from_dict(plan_dict))
    return pipe(PROMPTS, max_new_tokens=8)


def _rank(rank: int, port: int, out, world: int, folder: str, plan_dict: dict) -> None:
    run_in_group(rank, port, out, world, _pipeline_under, folder, plan_dict)


@pytest.mark.dist
def test_under_a_tensor_parallel_plan_the_text_is_one_processs(model_folder) -> None:
    graph = autopar.capture("tiny-llama", seq=32)
    plan = autopar.plan(graph, devices=2, global_batch=4, constraints=dict(
        tp=2, pp=1, dp=1, sequence_parallel=False, precision="fp32"))
    plan = with_full_size_layout(plan, "tiny-llama")  # attention split by heads
    expected = autopar.pipeline("text-generation", model=model_folder)(PROMPTS,
                                                                       max_new_tokens=8)
    (got,) = spawn_ranks(_rank, 2, (2, str(model_folder), plan.to_dict()), timeout_s=180)
    assert got == expected


def test_bad_inputs_are_refused_in_one_line(model_folder, hf_folder) -> None:
    cases = [
        (lambda: autopar.pipeline("summarization", model=model_folder), "unknown pipeline task"),
        (lambda: autopar.pipeline("text-generation", model=hf_folder("tiny-llama")),
         "no tokenizer"),
        (lambda: autopar.pipeline("text-generation", model=model_folder)(42),
         "a prompt is a string"),
        (lambda: autopar.pipeline("text-generation", model=model_folder)([]), "no prompt"),
    ]
    for call, message in cases:
        with pytest.raises(PlanError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
    assert torch.is_grad_enabled()  # nothing left switched off
