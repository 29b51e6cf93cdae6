"""Instruction data: the model's own tokenizer's ids, packed rows, and a loss that counts
response tokens only."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.data.dataset import TokenDataset
from autopar.data.instruction import prepare_instruction
from autopar.models.source import describe_source

from ..cli.test_inspect import _assert_one_line_error, cli_here, run_cli

SEQ = 32
PAIRS = [{"prompt": f"what is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."}
         for a in range(6) for b in range(5)]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """A small BPE trained on the pairs' text, saved with save_pretrained (BOS added)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [p["prompt"] for p in PAIRS] + [p["response"] for p in PAIRS]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    folder = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def dataset(tokenizer_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    stats = prepare_instruction([root / "pairs.jsonl"], root / "sft", tokenizer_folder, SEQ)
    return root / "sft", stats


def test_ids_are_the_tokenizers_own_and_only_responses_are_targets(tokenizer_folder,
                                                                    dataset) -> None:
    from transformers import AutoTokenizer

    prefix, stats = dataset
    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    ds = TokenDataset(prefix)
    assert stats["pairs"] == len(PAIRS) and ds.num_documents == stats["rows"]
    assert ds.num_tokens == stats["rows"] * (SEQ + 1)
    row, mask = ds.document(0), ds.mask[:SEQ + 1]
    at = 0
    for pair in PAIRS:  # the first row holds the first pairs, whole and in order
        prompt = tok(pair["prompt"])["input_ids"]
        response = tok(pair["response"], add_special_tokens=False)["input_ids"] + \
            [tok.eos_token_id]
        if at + len(prompt) + len(response) > SEQ + 1:
            break
        assert prompt[0] == tok.bos_token_id
        assert list(row[at:at + len(prompt)]) == prompt
        assert list(row[at + len(prompt):at + len(prompt) + len(response)]) == response
        assert not mask[at:at + len(prompt)].any() and mask[at + len(prompt):
                                                            at + len(prompt) + len(response)].all()
        at += len(prompt) + len(response)
    assert at > 0 and not mask[at:].any()  # padding is no target either
    with pytest.raises(autopar.PlanError, match=f"packed for sequences of {SEQ} tokens"):
        ds.rows(0, 2, SEQ * 2, 0, 0, 2)


def test_the_loss_ignores_prompt_tokens(dataset) -> None:
    from autopar.codegen.program import generated_program
    from autopar.train import Trainer

    prefix, _ = dataset
    plan = autopar.plan(autopar.capture("tiny-llama", seq=SEQ), devices=1, global_batch=2,
                        cluster="cpu", constraints=dict(microbatch_size=2, num_microbatches=1,
                                                        precision="fp32"))
    source = describe_source("tiny-llama")
    trainer = Trainer(source, plan, program=generated_program(plan, source),
                      data=str(prefix))
    ds = TokenDataset(prefix)
    rows, mask = ds.rows(0, 2, SEQ, 0, 0, 2), ds.loss_mask(0, 2, SEQ, 0, 0, 2)
    # each pair keeps to itself: positions restart after each end-of-sequence token
    assert trainer.document_eos == ds.eos_id is not None
    with torch.no_grad():
        logits = trainer.model(rows[:, :-1], **trainer.position_kwargs(rows[:, :-1])
                               ).logits.flatten(0, 1)
    targets = rows[:, 1:]
    masked = F.cross_entropy(logits, targets.masked_fill(~mask[:, 1:], -100).flatten())
    everything = F.cross_entropy(logits, targets.flatten())
    loss = trainer.train_step()
    assert loss == pytest.approx(float(masked), rel=1e-5)
    assert abs(float(masked) - float(everything)) > 1e-3  # the mask changed the loss


def test_bad_instruction_inputs_exit_2(tokenizer_folder, tmp_path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"question": "x"}) + "\n")
    _assert_one_line_error(run_cli("data", "prepare", str(pairs), "--format", "instruction",
                                   "--out", str(tmp_path / "a")), "--tokenizer", "--seq")
    _assert_one_line_error(cli_here("data", "prepare", str(pairs), "--format", "instruction",
                                   "--tokenizer", str(tokenizer_folder), "--seq", "32",
                                   "--out", str(tmp_path / "b")), "pairs.jsonl:2", "prompt")
    assert not list(tmp_path.glob("b*"))


def test_a_hub_id_is_refused_with_the_download_command(tmp_path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    hub_id = "meta-llama/Llama-3.2-1B"
    _assert_one_line_error(cli_here("data", "prepare", str(pairs), "--format", "instruction",
                                    "--tokenizer", hub_id, "--seq", "32",
                                    "--out", str(tmp_path / "a")),
                           "not a local folder", "never downloads",
                           f"huggingface-cli download {hub_id} --local-dir DIR", "pass DIR")
    assert not list(tmp_path.glob("a*"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    _assert_one_line_error(cli_here("generate", "tiny-llama", "--prompts", str(prompts),
                                    "--tokenizer", hub_id), f"download {hub_id}")


def test_tokenizers_load_with_local_files_only(tokenizer_folder, tmp_path, monkeypatch) -> None:
    import socket

    from transformers import AutoTokenizer

    from autopar.data.instruction import load_hf_tokenizer
    from autopar.errors import PlanError

    def no_network(*args, **kwargs):
        raise AssertionError("autopar tried the network for a tokenizer")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    seen: list[dict] = []
    real = AutoTokenizer.from_pretrained

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording)
    assert load_hf_tokenizer(tokenizer_folder).eos_token == "</s>"
    assert seen[-1].get("local_files_only") is True
    # a local folder without tokenizer files: one line, and still no download attempt
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PlanError, match="cannot load a tokenizer"):
        load_hf_tokenizer(empty)
    assert seen[-1].get("local_files_only") is True


# a chat template with Hugging Face's generation markers: its own assistant mask
# (return_assistant_tokens_mask) is what the loss must cover, content and end-of-turn token
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<s>assistant: {% generation %}"
    "{{ m['content'] }}</s>{% endgeneration %}\n{% else %}<s>{{ m['role'] }}: "
    "{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}")
CHATS = [[{"role": "system", "content": "you add"},
          {"role": "user", "content": f"what is {a} plus {b}?"},
          {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
          {"role": "user", "content": f"what is {b} plus {a}?"},
          {"role": "assistant", "content": f"{b} plus {a} is {a + b}."}]
         for a in range(3) for b in range(2)]


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer_folder, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    tok.chat_template = CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    tok.save_pretrained(folder)
    return folder


def test_conversations_train_exactly_the_templates_assistant_tokens(chat_tokenizer,
                                                                     tmp_path) -> None:
    from transformers import AutoTokenizer

    from autopar.data.instruction import chat_ids_and_mask

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    for chat in CHATS:
        own = tok.apply_chat_template(chat, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids, mask = chat_ids_and_mask(tok, chat, "chat")
        assert ids == list(own["input_ids"])
        assert mask == list(own["assistant_masks"]) and 0 < sum(mask) < len(mask)
    # prepared and packed as pairs are: the rows hold the template's ids, the mask its turns
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n"
                                                 for c in CHATS))
    stats = prepare_instruction([tmp_path / "chat.jsonl"], tmp_path / "chat", chat_tokenizer,
                                256)
    assert stats["cut"] == 0
    ds = TokenDataset(tmp_path / "chat")
    first, first_mask = chat_ids_and_mask(tok, CHATS[0], "chat")
    assert list(ds.document(0)[:len(first)]) == first
    assert list(ds.mask[:len(first)]) == first_mask
    assert stats["pairs"] == len(CHATS) and stats["trained_tokens"] == sum(
        sum(chat_ids_and_mask(tok, c, "chat")[1]) for c in CHATS)


def test_bad_conversations_fail_in_one_line(tokenizer_folder, chat_tokenizer) -> None:
    from transformers import AutoTokenizer

    from autopar.data.instruction import chat_ids_and_mask

    plain = AutoTokenizer.from_pretrained(tokenizer_folder)
    chat = AutoTokenizer.from_pretrained(chat_tokenizer)
    turns = CHATS[0]
    for tok, messages, message in (
            (plain, turns, "needs the tokenizer's chat template"),
            (chat, turns[:2], "no assistant turn"),
            (chat, [{"role": "user"}], "must be a non-empty list"),
            (chat, "hello", "must be a non-empty list")):
        with pytest.raises(autopar.PlanError, match=message):
            chat_ids_and_mask(tok, messages, "x.jsonl:1")
    chat.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(autopar.PlanError, match="cannot tell which tokens"):
        chat_ids_and_mask(chat, turns, "x.jsonl:1")
