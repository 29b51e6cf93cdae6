"""autopar.metrics.tasks on a tiny random Llama and a small BPE tokenizer: log-likelihood
multiple-choice scores equal to the same sum computed here straight from the Hugging Face
model, the fixed-shape mode equal to the free one, exact match with a fake generator, and the
two shipped sets."""

from __future__ import annotations

import datasets
import pytest
import torch

from autopar.errors import PlanError
from autopar.metrics import (
    accuracy,
    answer_predictions,
    choice_predictions,
    choice_scores,
    load_set,
    multiple_choice_accuracy,
    qa_exact_match,
    set_kind,
)
from autopar.models.hf import build_model
from tests.fixtures.tokenizers import word_bpe

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today",
          "what is two plus three", "which animal is a bird"]
N_RECORDS = 10  # of tiny-choice: 35 choice sequences, a few batches


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_set("tiny-choice").select(range(N_RECORDS)).to_list()


@pytest.fixture(scope="module")
def tokenizer(records):
    """A BPE of at most 256 ids (the tiny Llama's vocabulary) that prepends <s>."""
    text = CORPUS + [r["question"] + " " + " ".join(r["choices"]) for r in records]
    fast = word_bpe(text, 200)
    assert len(fast) <= 256
    return fast


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny-llama", device="cpu", dtype=torch.float32).eval()


def _logits_fn(model):
    return lambda ids: model(ids).logits


def _scores_by_hand(model, tokenizer, records) -> list[list[float]]:
    """Each choice's sequence alone (no padding), its log-softmax summed over its choice's
    tokens: the log-likelihood lm-evaluation-harness scores a choice by."""
    out = []
    with torch.no_grad():
        for r in records:
            row = []
            for choice in r["choices"]:
                ids = tokenizer(r["question"] + " " + choice)["input_ids"]
                start = len(tokenizer(r["question"])["input_ids"])
                assert ids[:start] == tokenizer(r["question"])["input_ids"]  # the plain path
                logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
                row.append(sum(float(logprobs[i - 1, ids[i]]) for i in range(start, len(ids))))
            out.append(row)
    return out


def test_choice_scores_equal_the_models_own_log_likelihoods(model, tokenizer, records) -> None:
    expected = _scores_by_hand(model, tokenizer, records)
    got = choice_scores(_logits_fn(model), tokenizer, records, batch_size=8)
    assert [len(s) for s in got] == [len(r["choices"]) for r in records]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)
    predictions = choice_predictions(_logits_fn(model), tokenizer, records)
    assert predictions == [max(range(len(s)), key=s.__getitem__) for s in expected]
    answers = [r["answer"] for r in records]
    result = multiple_choice_accuracy(_logits_fn(model), tokenizer, records)
    assert result == {"accuracy": accuracy(predictions, answers), "count": N_RECORDS}


def test_a_fixed_shape_gives_the_free_modes_predictions(model, tokenizer, records) -> None:
    shapes = []

    def recording(ids: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(ids.shape))
        return model(ids).logits

    free = choice_scores(_logits_fn(model), tokenizer, records)
    fixed = choice_scores(recording, tokenizer, records, width=40, batch_size=6)
    assert set(shapes) == {(6, 40)} and len(shapes) == 6  # 35 sequences: the last call padded
    for a, b in zip(fixed, free, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert choice_predictions(_logits_fn(model), tokenizer, records, width=40, batch_size=6) \
        == choice_predictions(_logits_fn(model), tokenizer, records)
    with pytest.raises(PlanError, match=r"tokens but width is 4; pass width >= \d+"):
        choice_predictions(_logits_fn(model), tokenizer, records, width=4)


class _MergingTokenizer:
    """Characters as ids after a BOS (1), but "? " is one token (99): the question's own ids
    are then not a prefix of question + " " + choice's."""

    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids, i = ([1] if add_special_tokens else []), 0
        while i < len(text):
            if text[i:i + 2] == "? ":
                ids.append(99)
                i += 2
            else:
                ids.append(2 + ord(text[i]) % 90)
                i += 1
        return {"input_ids": ids}


def test_a_tokenizer_that_merges_across_the_boundary_scores_the_parts_apart() -> None:
    seen = []

    def uniform(ids: torch.Tensor) -> torch.Tensor:
        seen.extend(ids.tolist())
        return torch.zeros(*ids.shape, 100)

    tok = _MergingTokenizer()
    record = {"question": "Why?", "choices": ["no", "yes"], "answer": 1}
    scores = choice_scores(uniform, tok, [record])
    question, space = tok("Why?")["input_ids"], tok(" ", add_special_tokens=False)["input_ids"]
    assert seen == [question + space + tok("no", False)["input_ids"] + [0],
                    question + space + tok("yes", False)["input_ids"]]
    # uniform logits: every choice token costs log(100), the space before it included
    assert scores[0] == pytest.approx([-3 * torch.log(torch.tensor(100.0)).item(),
                                       -4 * torch.log(torch.tensor(100.0)).item()])


def test_exact_match_with_a_fake_generator() -> None:
    records = load_set("tiny-qa").select(range(6)).to_list()
    assert [r["question"] for r in records[:2]] == ["What is 2 + 2?", "What is 7 + 1?"]
    replies = {
        "What is 2 + 2?": " Four.\nWhat is 3 + 3?",  # right: the second acceptable answer
        "What is 7 + 1?": "\n 8 \n",  # right: the first line once leading space is gone
        "What is 9 - 3?": "5",  # wrong
        "What is 5 times 2?": "ten apples",  # wrong: not the whole answer
        "How many days are in a week?": "SEVEN",  # right
        "How many legs does a dog have?": "",  # wrong: nothing said
    }
    prompts_seen = []

    def generate(prompts: list[str]) -> list[str]:
        prompts_seen.extend(prompts)
        return [replies[p] for p in prompts]

    assert qa_exact_match(generate, records) == {"exact_match": 0.5, "count": 6}
    assert prompts_seen == [r["question"] for r in records]
    assert answer_predictions(generate, records) == ["Four.", "8", "5", "ten apples", "SEVEN",
                                                     ""]
    one_answer = [{"question": "What is 2 + 2?", "answer": "4"}]
    assert qa_exact_match(generate, one_answer) == {"exact_match": 0.0, "count": 1}


def test_the_shipped_sets() -> None:
    choice, qa = load_set("tiny-choice"), load_set("tiny-qa")
    assert isinstance(choice, datasets.Dataset) and isinstance(qa, datasets.Dataset)
    assert (choice.num_rows, qa.num_rows) == (24, 24)
    assert choice.column_names == ["question", "choices", "answer"]
    assert qa.column_names == ["question", "answer"]
    for r in choice:
        assert r["question"] and 3 <= len(r["choices"]) <= 4
        assert 0 <= r["answer"] < len(r["choices"])
    for r in qa:
        assert r["question"] and 1 <= len(r["answer"]) <= 2 and all(r["answer"])
    assert (set_kind(choice), set_kind(qa)) == ("multiple_choice", "qa")
    assert set_kind(choice.to_list()) == "multiple_choice"


@pytest.mark.parametrize("call, words", [
    (lambda: load_set("mmlu"), "unknown evaluation set 'mmlu'; use one of tiny-choice, tiny-qa"),
    (lambda: set_kind([{"text": "hi", "label": 1}]),
     "columns ['text', 'label']; a multiple-choice set needs question, choices, answer"),
    (lambda: multiple_choice_accuracy(lambda ids: ids, None, [
        {"question": "q", "choices": ["a", "b"], "answer": 2}]),
     "record 0's answer 2 is not a choice index in 0..1"),
    (lambda: choice_scores(lambda ids: torch.zeros(ids.shape[0], 3), _MergingTokenizer(), [
        {"question": "q", "choices": ["a"]}]), "logits_fn returned shape (1, 3)"),
    (lambda: choice_scores(lambda ids: ids, _MergingTokenizer(), [
        {"question": "q", "choices": "ab"}]), "not a non-empty list of strings"),
    (lambda: qa_exact_match(lambda prompts: ["x"], [
        {"question": "a", "answer": "x"}, {"question": "b", "answer": "y"}]),
     "generate_fn returned 1 items for 2 prompts"),
    (lambda: qa_exact_match(lambda prompts: ["x"], [{"question": "a", "answer": []}]),
     "record 0's answer [] is not a string or a non-empty list"),
])
def test_bad_inputs_are_refused_in_one_line(call, words) -> None:
    with pytest.raises(PlanError) as caught:
        call()
    message = str(caught.value)
    assert words in message
    assert "\n" not in message
