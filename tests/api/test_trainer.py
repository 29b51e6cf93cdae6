"""autopar.Trainer as a user calls it: the README's example in one process and under torchrun
(same losses), its arguments' names, streamed, chat and blended data, evaluation on the
shipped sets, a module's own weights, and bad inputs refused in one line."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

import autopar
from autopar.data.dataset import TokenDataset
from autopar.data.documents import document_positions
from autopar.data.instruction import chat_ids_and_mask
from autopar.data.sets import load_text_set, text_set_rows
from autopar.errors import PlanError
from autopar.metrics import load_set
from autopar.metrics.tasks import multiple_choice_accuracy

ROOT = Path(__file__).resolve().parents[2]


def _args(out: Path, **kw) -> autopar.TrainingArguments:
    settings = dict(output_dir=str(out), max_steps=2, global_batch_size=4, max_seq_length=32,
                    learning_rate=3e-3, use_cpu=True, logging_steps=1, save_strategy="no")
    return autopar.TrainingArguments(**{**settings, **kw})


def _losses(run: Path) -> list[float]:
    lines = (run / "logs" / "train.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def readme_example() -> str:
    """The README's five-line example, as a user copies it."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Train, evaluate and generate in five lines", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.dist
def test_the_readme_example_trains_alike_in_one_process_and_under_torchrun(tmp_path) -> None:
    script = tmp_path / "five.py"
    script.write_text(readme_example())
    runs = {"one": [sys.executable, str(script)],
            "two": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(script)]}
    out = {}
    for name, command in runs.items():
        (tmp_path / name).mkdir()
        done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                              cwd=tmp_path / name)
        assert done.returncode == 0, done.stderr[-2000:]
        out[name] = done.stdout
    plan = autopar.Plan.load(tmp_path / "two" / "run" / "plan.yaml")
    assert plan.devices == 2 and plan.global_batch == 8
    expected, got = _losses(tmp_path / "one" / "run"), _losses(tmp_path / "two" / "run")
    assert len(expected) == 10 and expected[-1] < expected[0]
    assert got == pytest.approx(expected, abs=1e-4)
    evals = [_printed_eval(out["one"])] + [ast.literal_eval(line) for line in
                                           out["two"].splitlines() if "eval_loss" in line]
    assert len(evals) == 3  # one process, then each of the two ranks
    assert [e["eval_loss"] for e in evals] == pytest.approx([evals[0]["eval_loss"]] * 3,
                                                            abs=1e-4)
    assert out["two"].count("[\'") >= 2  # each rank printed the generated text


def _printed_eval(text: str) -> dict:
    """The evaluation dict the quickstart prints (a Python literal)."""
    line = next(ln for ln in text.splitlines() if ln.startswith("{'eval_loss'"))
    return ast.literal_eval(line)


def test_arguments_take_hugging_faces_names_and_refuse_other_meanings() -> None:
    args = autopar.TrainingArguments(per_device_train_batch_size=4,
                                     gradient_accumulation_steps=2, warmup_ratio=0.1)
    assert args.global_batch(4) == 32  # per device x accumulation x processes, as in HF
    assert autopar.TrainingArguments(global_batch_size=8).global_batch(4) == 8
    assert args.warmup(100) == 10
    assert args.steps(rows_per_epoch=100, global_batch=32) == 10  # 3 epochs of 100 rows
    cases = [(dict(fsdp="full_shard"), "constraints=\\{'zero': 3\\}"),
             (dict(deepspeed="ds.json"), "ZeRO itself"),
             (dict(learning_rat=1e-3), "did you mean learning_rate"),
             (dict(lr_scheduler_type="constant", warmup_steps=5), "constant_with_warmup"),
             (dict(lr_scheduler_type="polynomial"), "not in autopar"),
             (dict(bf16=True, fp16=True), "choose one"),
             (dict(per_device_eval_batch_size=2), "not read by autopar"),
             (dict(max_steps=0), "set max_steps")]
    for kwargs, message in cases:
        with pytest.raises(PlanError, match=message) as info:
            autopar.TrainingArguments(**kwargs)
        assert "\n" not in str(info.value)


def test_a_streamed_dataset_is_read_only_as_far_as_the_run_needs(tmp_path) -> None:
    read = []

    def rows():
        for row in text_set_rows("tiny-text"):
            read.append(row)
            yield row

    stream = datasets.IterableDataset.from_generator(rows)
    trainer = autopar.Trainer("tiny-llama", args=_args(tmp_path / "run"),
                              train_dataset=stream)
    # 2 steps x 4 rows x 33 tokens need ~25 sentences; a few more are read ahead
    assert len(read) < 60
    assert TokenDataset(tmp_path / "run" / "data" / "train").num_windows(32) >= 8
    out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))


def test_conversations_train_exactly_the_assistant_tokens(tmp_path) -> None:
    chats = [[{"role": "user", "content": "what sat on the mat?"},
              {"role": "assistant", "content": "the red cat."}],
             [{"role": "system", "content": "be brief."},
              {"role": "user", "content": "where did the dog run?"},
              {"role": "assistant", "content": "to the river."},
              {"role": "user", "content": "when?"},
              {"role": "assistant", "content": "at night."}]]
    data = datasets.Dataset.from_list([{"messages": c} for c in chats])
    trainer = autopar.Trainer("tiny-llama", args=_args(tmp_path / "run", max_seq_length=128),
                              train_dataset=data)
    assert trainer.train_data["kind"] == "chat"
    tok = trainer.tokenizer
    ds = TokenDataset(tmp_path / "run" / "data" / "train")
    ids, mask = ds.tokens[:].tolist(), ds.mask[:].tolist()
    start = 0
    for chat in chats:  # both fit one row of 129 tokens: packed one after the other
        own = list(tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
        assert ids[start:start + len(own)] == own  # the tokenizer's own template
        trained = [i for i, m in zip(own, mask[start:start + len(own)], strict=True) if m]
        answers = [m["content"] for m in chat if m["role"] == "assistant"]
        # exactly each assistant turn's content and its end-of-turn token
        assert tok.decode(trained) == "".join(a + tok.eos_token for a in answers)
        assert chat_ids_and_mask(tok, chat, "chat") == (own, mask[start:start + len(own)])
        start += len(own)
    assert sum(mask[start:]) == 0  # padding is not trained


def test_a_blend_draws_its_rows_by_weight_for_any_split(tmp_path) -> None:
    cats = datasets.Dataset.from_list([r for r in text_set_rows("tiny-text") if "cat" in
                                       r["text"]] * 4)
    dogs = datasets.Dataset.from_list([r for r in text_set_rows("tiny-text") if "dog" in
                                       r["text"]] * 4)
    trainer = autopar.Trainer("tiny-llama", args=_args(tmp_path / "run"),
                              train_dataset=[(cats, 0.75), (dogs, 0.25)])
    from autopar.data.dataset import open_source

    blend = open_source(trainer.train_data["prefix"], 256)
    assert blend.shares(400) == pytest.approx([0.75, 0.25])
    whole = blend.rows(3, 8, 32, 42, 0, 8)
    halves = torch.cat([blend.rows(3, 8, 32, 42, 0, 4), blend.rows(3, 8, 32, 42, 4, 4)])
    assert torch.equal(whole, halves)  # what a dp rank reads is its share of the same batch
    assert trainer.train().global_step == 2


def test_evaluate_and_predict_match_the_exported_model(tmp_path) -> None:
    trainer = autopar.Trainer("tiny-llama", args=_args(tmp_path / "run", save_strategy="steps"),
                              train_dataset=load_text_set())
    trainer.train()
    folder = trainer.save_model(str(tmp_path / "hf"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    choice = load_set("tiny-choice")
    got = trainer.evaluate(choice)
    with torch.no_grad():
        expected = multiple_choice_accuracy(lambda ids: model(ids).logits, trainer.tokenizer,
                                            [dict(r) for r in choice])
    assert got == {"eval_accuracy": expected["accuracy"], "eval_count": 24}
    texts = trainer.predict(["the red cat", "a dog"], max_new_tokens=6).predictions
    pipe = autopar.pipeline("text-generation", model=folder, tokenizer=trainer.tokenizer)
    assert texts == [o[0]["generated_text"] for o in
                     pipe(["the red cat", "a dog"], max_new_tokens=6, return_full_text=False)]
    qa = trainer.predict(load_set("tiny-qa"), max_new_tokens=4)
    assert len(qa.predictions) == 24 and 0.0 <= qa.metrics["exact_match"] <= 1.0


def test_a_module_trains_from_its_own_weights(tmp_path) -> None:
    from autopar.models.hf import build_model

    torch.manual_seed(123)  # not the seed the runtime would draw weights from
    module = build_model("tiny-llama", device="cpu", dtype=torch.float32)
    trainer = autopar.Trainer(module, args=_args(tmp_path / "run", max_steps=1),
                              train_dataset=load_text_set(),
                              tokenizer=ROOT / "autopar/models/tokenizers/tiny")
    data = TokenDataset(tmp_path / "run" / "data" / "train")
    rows = data.rows(0, 4, 32, 42, 0, 4)
    with torch.no_grad():  # the documents packed in a row kept apart, as the run does
        logits = module(rows[:, :-1], position_ids=document_positions(rows[:, :-1],
                                                                      data.eos_id)).logits
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256),
                                                     rows[:, 1:].reshape(-1))
    assert trainer.train().training_loss == pytest.approx(float(expected), abs=1e-5)


def test_bad_inputs_are_refused_in_one_line(tmp_path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    text = load_text_set()
    cases = [
        (lambda: autopar.Trainer("tiny-llama", args=_args(tmp_path / "a"),
                                 data_collator=object()), "packs rows itself"),
        (lambda: autopar.Trainer("tiny-llama", args=_args(tmp_path / "mine"),
                                 train_dataset=text), "not an autopar run directory"),
        (lambda: autopar.Trainer("tiny-llama", args=_args(tmp_path / "b"),
                                 train_dataset=datasets.Dataset.from_list([{"body": "x"}])),
         "dataset_text_field; data.text_field"),
        (lambda: autopar.Trainer("tiny-llama", args=_args(tmp_path / "c", max_steps=-1),
                                 train_dataset=text.to_iterable_dataset()), "set max_steps"),
        (lambda: autopar.Trainer(42, args=_args(tmp_path / "d")), "a model is an nn.Module"),
        (lambda: autopar.Trainer("llama3-8b", args=_args(tmp_path / "e"),
                                 train_dataset=text), "needs the model's tokenizer"),
    ]
    for call, message in cases:
        with pytest.raises(PlanError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def _train_under(out: str, constraints: dict | None) -> list[float]:
    args = _args(Path(out), max_steps=3, global_batch_size=4, constraints=constraints)
    trainer = autopar.Trainer("tiny-llama", args=args, train_dataset=load_text_set())
    assert trainer._ensure_runtime().document_eos is not None  # documents kept apart
    return trainer.train().metrics["losses"]


def _tp_rank(rank: int, port: int, out, world: int, folder: str) -> None:
    from tests.fixtures.harness import run_in_group

    run_in_group(rank, port, out, world, _train_under, folder, {"tp": 2, "dp": 1})


@pytest.mark.dist
def test_tensor_parallel_with_documents_kept_apart_equals_one_process(tmp_path) -> None:
    from tests.fixtures.harness import spawn_ranks

    expected = _train_under(str(tmp_path / "one"), None)
    (got,) = spawn_ranks(_tp_rank, 2, (2, str(tmp_path / "tp")), timeout_s=240)
    assert autopar.Plan.load(tmp_path / "tp" / "plan.yaml").mesh["tp"] == 2
    assert got == pytest.approx(expected, abs=1e-4)
