"""autopar.metrics.scores: values worked out by hand, ``load(name).compute`` equal to the plain
functions, and what a user can get wrong refused in one line."""

from __future__ import annotations

import math

import pytest

from autopar.errors import PlanError
from autopar.metrics import accuracy, exact_match, load, normalize_answer, perplexity


def test_accuracy_by_hand() -> None:
    assert accuracy([1, 0, 2], [1, 1, 2]) == pytest.approx(2 / 3)
    assert accuracy(["a"], ["a"]) == 1.0
    assert accuracy((0, 0), (1, 1)) == 0.0


def test_exact_match_normalizes_as_squad_does() -> None:
    assert exact_match(["The  Cat."], ["cat"]) == 1.0
    assert exact_match(["an apple!"], ["Apple"]) == 1.0
    assert exact_match(["Theater"], ["ater"]) == 0.0  # "the" is dropped only as a word
    assert exact_match(["Paris", "rome", "x"], ["paris", "Rome", "y"]) == pytest.approx(2 / 3)
    assert exact_match(["The  Cat."], ["cat"], normalize=False) == 0.0
    assert normalize_answer("  A  quick,  brown FOX. ") == "quick brown fox"


def test_perplexity_is_exp_and_does_not_overflow() -> None:
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(7.5)) == pytest.approx(7.5)
    assert perplexity(1e6) == math.inf
    assert perplexity(709.0) == pytest.approx(math.exp(709.0))


def test_load_compute_equals_the_plain_functions() -> None:
    preds, refs = [1, 0, 2, 2], [1, 1, 2, 0]
    assert load("accuracy").compute(predictions=preds, references=refs) == {
        "accuracy": accuracy(preds, refs)}
    texts, answers = ["The Cat", "a dog", "Bird"], ["cat", "dogs", "bird."]
    assert load("exact_match").compute(predictions=texts, references=answers) == {
        "exact_match": exact_match(texts, answers)}
    assert load("exact_match").compute(predictions=texts, references=answers,
                                       normalize=False) == {"exact_match": 0.0}


@pytest.mark.parametrize("call, words", [
    (lambda: load("bleu"), "unknown metric 'bleu'; use one of accuracy, exact_match"),
    (lambda: accuracy([1, 2], [1]), "2 predictions but 1 references"),
    (lambda: accuracy([], []), "at least one example"),
    (lambda: exact_match("cat", "cat"), "predictions must be a list"),
    (lambda: exact_match([1], ["1"]), "exact_match compares strings"),
    (lambda: load("accuracy").compute(predictions=[1], references=[1], normalize=True),
     "does not take normalize"),
])
def test_bad_inputs_are_refused_in_one_line(call, words) -> None:
    with pytest.raises(PlanError) as caught:
        call()
    message = str(caught.value)
    assert words in message
    assert "\n" not in message
