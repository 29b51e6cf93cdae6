"""Codegen: the artifact directory (plan, manifest) and the program generated from the plan:
the training program (train.py), or for a plan of task "infer" the generation program
(generate.py)."""

from autopar.artifact import PROGRAM_FILE, load_artifact, load_program, program_state
from autopar.codegen.artifact import (
    compile_artifact,
    program_file,
    program_for,
    regenerate_program,
)
from autopar.codegen.generate_program import GENERATE_FILE, generate_program_text
from autopar.codegen.program import (
    generated_program,
    model_program,
    model_program_text,
    program_text,
)

__all__ = ["GENERATE_FILE", "PROGRAM_FILE", "compile_artifact", "generate_program_text",
           "generated_program", "load_artifact", "load_program", "model_program",
           "model_program_text", "program_file", "program_for",
           "program_state", "program_text", "regenerate_program"]
