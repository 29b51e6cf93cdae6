"""How the shipped tiny text set and the tiny tokenizer were made (run ``python -m
autopar.data.sets.build`` to write them again; the output is deterministic).

``tiny_text.jsonl``: 400 short English sentences from a few templates, written for autopar so
that a tiny model can be trained, evaluated and sampled with nothing downloaded. It tests the
plumbing; a model that learns it learns the templates.

``autopar/models/tokenizers/tiny``: a BPE of 256 tokens (what the shipped tiny configs'
vocabularies hold) trained on that text, SentencePiece-style word boundaries (``▁``) so that
decoding restores the spaces, with a chat template.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
TOKENIZER_DIR = HERE.parent.parent / "models" / "tokenizers" / "tiny"
ANIMALS = ["cat", "dog", "bird", "fox", "horse", "mouse", "cow", "duck"]
PLACES = ["mat", "hill", "road", "farm", "river", "garden", "roof", "field"]
VERBS = ["sat on", "ran to", "slept by", "walked across", "looked at", "jumped over"]
TIMES = ["in the morning", "at night", "after lunch", "on sunday", "before the rain"]
COLORS = ["red", "blue", "green", "brown", "white", "black"]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# each turn: its role marker, the content, the end-of-sequence token; the generation prompt
# opens the assistant's turn
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def sentences(count: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    combos = list(itertools.product(ANIMALS, VERBS, PLACES))
    rng.shuffle(combos)
    out = []
    for i in range(count):
        animal, verb, place = combos[i % len(combos)]
        color, time = rng.choice(COLORS), rng.choice(TIMES)
        out.append(f"the {color} {animal} {verb} the {place} {time}.")
    return out


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    extra = "abcdefghijklmnopqrstuvwxyz0123456789.,?!'-:;\n"
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=256, special_tokens=SPECIAL, initial_alphabet=list(extra),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    texts = sentences()
    with open(HERE / "tiny_text.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tok = train_tokenizer(texts)
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(TOKENIZER_DIR)
    print(f"{len(texts)} sentences; tokenizer of {len(tok)} tokens in {TOKENIZER_DIR}")


if __name__ == "__main__":
    main()
