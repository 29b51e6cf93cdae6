"""Number formatting shared by every renderer (so text, markdown and HTML print the same)."""

from __future__ import annotations

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "kv_cache", "buffers")
MEMORY_LABELS = {"params": "params", "grads": "grads", "optimizer": "optimizer",
                 "activations": "activations", "kv_cache": "kv cache", "buffers": "buffers"}
TIME_TERMS = ("compute_s", "recompute_s", "comm_s", "bubble_s", "dp_comm_s", "optimizer_s",
              "offload_s")
TIME_LABELS = {"compute_s": "compute", "recompute_s": "recompute",
               "comm_s": "tp/ep communication", "bubble_s": "pipeline bubble",
               "dp_comm_s": "data-parallel comm (exposed)", "optimizer_s": "optimizer step",
               "offload_s": "offload transfers (exposed)"}


def nbytes(n: float | None) -> str:
    """Bytes in decimal units, three significant figures: ``53.4 GB``."""
    if n is None:
        return "-"
    for scale, suffix in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{n:.3g} B"


def seconds(s: float | None) -> str:
    """``8.3 s``, ``174 ms``, ``1.96 us``; ``0 s`` for zero."""
    if s is None:
        return "-"
    if abs(s) < 1e-10:  # nothing worth a digit (a float's leftovers)
        return "0 s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def count(n: float) -> str:
    """``253 k`` (three significant figures with an SI prefix)."""
    for scale, suffix in ((1e12, " T"), (1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def pct(x: float | None, signed: bool = False) -> str:
    """``65.1%``; ``+12.0%`` when signed."""
    if x is None:
        return "-"
    return f"{x:+.1%}" if signed else f"{x:.1%}"


def change(x: float | None) -> str:
    """A relative change: ``+12.0%``, or ``x35.2`` once it is a multiple."""
    if x is None:
        return "-"
    return f"{x:+.1%}" if abs(x) < 10 else f"x{1 + x:.3g}"


def delta_seconds(s: float) -> str:
    """A signed duration: ``+174 ms``, ``-1.2 s``."""
    return ("+" if s >= 0 else "-") + seconds(abs(s))


def mesh(m: dict, cp_mode: str | None = None) -> str:
    """``pp=1 dp=64 tp=1 ep=1``; ``pp=16 dp=8 cp=16 tp=8 ep=1`` with context parallelism,
    ``... cp=16 (allgather) tp=8 ...`` given how its ranks exchange keys and values."""
    cp = m.get("cp", 1)
    axes = ("pp", "dp", "cp", "tp", "ep") if cp > 1 else ("pp", "dp", "tp", "ep")
    return " ".join(f"{k}={m[k]}" + (f" ({cp_mode})" if k == "cp" and cp_mode else "")
                    for k in axes)


def recompute_counts(counts: dict[str, int]) -> str:
    """``none on all 34 blocks`` or ``full 4, none 30``."""
    if len(counts) == 1:
        (mode, n), = counts.items()
        return f"{mode} on all {n} blocks"
    return ", ".join(f"{mode} {n}" for mode, n in counts.items())


def recompute_short(counts: dict[str, int | None]) -> str:
    """For a table cell: ``none`` when every block shares a mode, else ``full 30, none 4``
    (a mode without a count is named alone)."""
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{k} {v}" if v is not None else k for k, v in counts.items())


def offload(items: list[str]) -> str:
    """``optimizer+params``, or ``none``."""
    return "+".join(items) if items else "none"
