"""What an export carries over from the folder a run's weights started from (``autopar run
--init-from FOLDER``): its path, as the adapter's ``base_model_name_or_path``, and its
tokenizer files, so that the exported folder is usable without hunting for them.

The folder is recorded (absolute) in each checkpoint's ``meta.json`` at run time; a resumed
run keeps the one its checkpoint names. Only the fixed file names below are copied, and only
regular files: the recorded path is data, never a pattern.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# transformers' tokenizer files: fast (tokenizer.json), slow BPE (vocab.json + merges.txt),
# WordPiece (vocab.txt), SentencePiece models, added tokens, and the chat template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "chat_template.jinja", "chat_template.json")


def recorded_init_from(checkpoint: Path) -> str | None:
    """The ``--init-from`` folder the checkpoint's run started from, or None (random
    initialisation, or a checkpoint written before autopar recorded it)."""
    meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    value = meta.get("init_from")
    return value if isinstance(value, str) and value else None


def copy_tokenizer_files(base: str | None, out: Path) -> list[str]:
    """Copy ``base``'s tokenizer files that exist into ``out``; returns their names (none
    when ``base`` is None or no longer there)."""
    if base is None or not Path(base).is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        source = Path(base) / name
        if source.is_file() and not (out / name).exists():
            shutil.copyfile(source, out / name)
            copied.append(name)
    return copied


__all__ = ["TOKENIZER_FILES", "copy_tokenizer_files", "recorded_init_from"]
