"""Codegen: the artifact directory (plan, manifest) and the training program generated from
the plan."""

from autopar.codegen.artifact import compile_artifact, load_artifact, regenerate_program
from autopar.codegen.program import (
    PROGRAM_FILE,
    generated_program,
    load_program,
    program_state,
    program_text,
)

__all__ = ["PROGRAM_FILE", "compile_artifact", "generated_program", "load_artifact", "load_program",
           "program_state", "program_text", "regenerate_program"]
