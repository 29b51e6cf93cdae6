"""Parameter-efficient fine-tuning on CPU, end to end with the command line: a tiny Llama and a
tokenizer saved locally (random weights stand in for a downloaded checkpoint), instruction
pairs tokenized with that tokenizer, a fine-tuning plan for 2 processes, 30 steps from the
saved weights under torchrun, the adapter exported (only the trained weights) and applied to
the unsharded Hugging Face model.

Run: python examples/finetune_peft_cpu.py [WORK_DIR] [--peft prefix_tuning]
     (any of lora, prefix_tuning, adapter, low_rank_adapter, bitfit; or k=v settings)
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from autopar.models.hf import build_model, load_config
from autopar.peft.saved import load_adapter

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("work", nargs="?", default="peft-example")
ap.add_argument("--peft", default="method=lora,r=8,lora_alpha=16,target_modules=all-linear")
args = ap.parse_args()
work = Path(args.work)
base, art, adapter = work / "base", work / "artifact", work / "adapter"

# 1. a base model and its tokenizer, saved as a Hugging Face folder
pairs = [{"prompt": f"what is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."}
         for a in range(10) for b in range(10)]
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.train_from_iterator([p["prompt"] + " " + p["response"] for p in pairs], trainers.BpeTrainer(
    vocab_size=200, special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
tok.post_processor = processors.TemplateProcessing(
    single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                        pad_token="<pad>", unk_token="<unk>").save_pretrained(base)
torch.manual_seed(0)
build_model(dict(load_config("tiny-llama"), vocab_size=256), device="cpu",
            dtype=torch.float32).save_pretrained(base)
(work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))


def autopar(*argv: str, procs: int = 0) -> None:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(procs)] if procs else []
    subprocess.run([sys.executable, *launcher, "-m", "autopar", *argv], check=True)


# 2. the pairs in the model's own tokens; only the responses are trained targets
autopar("data", "prepare", str(work / "pairs.jsonl"), "--format", "instruction",
        "--tokenizer", str(base), "--seq", "32", "--out", str(work / "sft"))
# 3. a fine-tuning plan: the planner prices what the method freezes
autopar("compile", str(base), "--devices", "2", "--global-batch", "8", "--seq", "32",
        "--cluster", "cpu", "--task", "finetune", "--peft", args.peft,
        "--constraints", "precision=fp32", "--out", str(art), "-q")
# 4. train from the saved weights on 2 processes
autopar("run", str(art), "--steps", "30", "--lr", "0.01", "--device", "cpu",
        "--init-from", str(base), "--data", str(work / "sft"), procs=2)
losses = [json.loads(line)["loss"] for line in (art / "logs" / "train.jsonl").open()]
print(f"loss: {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
# 5. only the trained weights leave the run; they apply to the unsharded model
autopar("export", str(art), "--to", "hf", str(adapter))
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
method = load_adapter(model, adapter).method
trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
size = (adapter / "adapter_model.safetensors").stat().st_size
print(f"{method}: {trained:,} trained parameters, adapter file {size:,} bytes")
