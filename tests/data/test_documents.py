"""Packed documents kept apart: positions restart after each end-of-document token, and the
model then attends within a document only; where a run cannot, it says why."""

from __future__ import annotations

import dataclasses

import datasets
import pytest
import torch

import autopar
from autopar.data.documents import document_positions
from autopar.train.document_mask import document_mask_choice


def test_positions_restart_after_each_end_token() -> None:
    ids = torch.tensor([[5, 6, 3, 7, 8, 9, 3, 4], [3, 3, 1, 2, 3, 4, 5, 6]])
    assert document_positions(ids, 3).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0],
                                                   [0, 0, 0, 1, 2, 0, 1, 2]]


@pytest.mark.parametrize("mask", [True, False])
def test_a_document_sees_only_itself_when_the_run_keeps_them_apart(tmp_path, mask) -> None:
    texts = ["the red cat sat on the mat.", "a brown dog ran to the river at night."]
    args = autopar.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1,
                                     global_batch_size=1, max_seq_length=16, use_cpu=True,
                                     document_mask=mask)
    trainer = autopar.Trainer("tiny-llama", args=args,
                              train_dataset=datasets.Dataset.from_list(
                                  [{"text": t} for t in texts * 4]))
    runtime = trainer._ensure_runtime()
    tok = trainer.tokenizer
    first = tok(texts[0], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    second = tok(texts[1], add_special_tokens=False)["input_ids"]
    packed = torch.tensor([first + second])
    with torch.no_grad():
        both = runtime.model(packed, **runtime.position_kwargs(packed)).logits
        alone = runtime.model(torch.tensor([second])).logits
    kept_apart = torch.allclose(both[0, len(first):], alone[0], atol=1e-5)
    assert kept_apart == mask
    assert ("kept apart" in runtime.document_choice) == mask


def test_each_run_that_cannot_keep_documents_apart_says_why(tmp_path) -> None:
    from autopar.models.hf import build_model

    model = build_model("tiny-llama", device="meta")
    plan = autopar.plan("tiny-llama", devices=2, cluster="cpu", global_batch=2, seq=32,
                        constraints={"pp": 2})

    class Data:
        eos_id = 3

    assert document_mask_choice(model, plan, Data())[1].endswith(
        "(pipeline stages are traced with the token ids alone)")
    one = dataclasses.replace(plan, mesh={**plan.mesh, "pp": 1})
    assert document_mask_choice(model, one, Data())[0] == 3
    assert "no end-of-document token" in document_mask_choice(model, one, object())[1]
    assert "takes no position_ids" in document_mask_choice(torch.nn.Linear(2, 2), one,
                                                           Data())[1]
