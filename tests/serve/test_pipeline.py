"""autopar.pipeline("text-generation"): greedy text equal to Hugging Face's own text-generation
pipeline and to autopar.Generator on the same weights and tokenizer; chat messages through the
tokenizer's chat template; bad inputs refused in one line."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

import autopar
from autopar.errors import PlanError
from tests.fixtures.harness import run_in_group, spawn_ranks
from tests.fixtures.layouts import with_full_size_layout

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today",
          "we read a book at night", "user: hello there assistant: hi"]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["the cat sat", "a dog ran in the park and"]


@pytest.fixture(scope="module")
def model_folder(hf_folder, tmp_path_factory):
    """Tiny Llama's Hugging Face folder (seed-0 weights) with a small BPE tokenizer saved
    beside it, as a model downloaded from the Hub holds both."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("llama-with-tokenizer") / "model"
    shutil.copytree(hf_folder("tiny-llama"), folder)
    fast.save_pretrained(folder)
    return folder


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
