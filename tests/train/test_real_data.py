"""Training on a prepared token dataset: each rank reads its rows; dp equals one process."""

from __future__ import annotations

import random

import pytest

import autopar
from autopar.data.prepare import prepare
from autopar.models import GPT, GPTConfig, token_inputs
from autopar.models.source import describe_source
from tests.fixtures.harness import run_ranks
from tests.parallel.test_equivalence import _plan

pytestmark = pytest.mark.dist


def test_dp2_on_prepared_data_matches_one_process(tmp_path) -> None:
    rng = random.Random(0)
    words = ["pipeline", "tensor", "shard", "gradient", "mesh", "stage", "token", "batch"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(40))
                                for _ in range(300)) + "\n")
    stats = prepare([corpus], tmp_path / "tok", tokenizer=None, vocab_size=400)
    model = GPT(GPTConfig(vocab_size=512, seq_len=32, d_model=64, n_layers=2, n_heads=4))
    source, graph = describe_source(model), autopar.capture(model, token_inputs(1, 32))
    data = str(tmp_path / "tok")
    one, _ = run_ranks(source, _plan(graph, 1, microbatch_size=2), 4, data=data)
    two, _ = run_ranks(source, _plan(graph, 2, dp=2, zero_stage=3, microbatch_size=1), 4,
                       data=data)
    assert two == pytest.approx(one, rel=1e-4)
    synthetic, _ = run_ranks(source, _plan(graph, 1, microbatch_size=2), 1)
    assert synthetic[0] != pytest.approx(one[0], rel=1e-3)  # the data really is different
    assert stats["tokens"] > 1000


def test_dataset_with_a_larger_vocabulary_is_refused(tmp_path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"line {i} with some words" for i in range(200)) + "\n")
    prepare([corpus], tmp_path / "tok", tokenizer=None, vocab_size=400)
    model = GPT(GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=1, n_heads=4))
    source, graph = describe_source(model), autopar.capture(model, token_inputs(1, 32))
    with pytest.raises(RuntimeError, match="vocab"):
        run_ranks(source, _plan(graph, 1, microbatch_size=2), 1, data=str(tmp_path / "tok"))
