"""autopar.Trainer in five lines: train a tiny Llama on a datasets.Dataset, evaluate it, and
generate, under the plan autopar makes for the processes it is launched on.

Run: python examples/trainer_quickstart.py [OUTPUT_DIR]
     torchrun --nproc-per-node 2 examples/trainer_quickstart.py [OUTPUT_DIR]
(the same losses either way: the global batch is fixed, the plan splits it)
"""

import sys

import autopar
from autopar.data.sets import load_text_set

out = sys.argv[1] if len(sys.argv) > 1 else "quickstart-run"
data = load_text_set("tiny-text").train_test_split(test_size=0.1, seed=0)  # a datasets.DatasetDict

# the five lines
args = autopar.TrainingArguments(output_dir=out, max_steps=10, global_batch_size=8,
                                 max_seq_length=32, learning_rate=3e-3, use_cpu=True,
                                 logging_steps=5, overwrite_output_dir=True)
trainer = autopar.Trainer("tiny-llama", args=args, train_dataset=data["train"],
                          eval_dataset=data["test"])
trainer.train()
print(trainer.evaluate())
print(trainer.predict(["the red cat"], max_new_tokens=8).predictions)
