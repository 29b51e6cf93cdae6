"""The artifact directory ``autopar compile`` writes, as its readers see it: loading and
checking it, the program's state and digests, loading a program's text, and the atomic swap
that replaces one artifact with another (``swap``)."""

from autopar.artifact.load import (
    MANIFEST_VERSION,
    PROGRAM_FILE,
    check_versions,
    digest,
    is_artifact,
    library_versions,
    load_artifact,
    load_program,
    program_state,
)

__all__ = ["MANIFEST_VERSION", "PROGRAM_FILE", "check_versions", "digest", "is_artifact",
           "library_versions", "load_artifact", "load_program", "program_state"]
