"""Codegen pass: turn a Plan into a runnable artifact directory."""

from autopar.codegen.artifact import compile_artifact, load_artifact, recipe_text

__all__ = ["compile_artifact", "load_artifact", "recipe_text"]
