"""Plain-text and markdown renderings of the report sections."""

from __future__ import annotations

from autopar.report.sections import Section


def text_table(headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset(),
               indent: str = "  ") -> list[str]:
    """Columns padded to their widest cell; ``numeric`` columns aligned right."""
    cells = [headers, *rows] if headers else rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]

    def line(row: list[str]) -> str:
        parts = [c.rjust(w) if i in numeric else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return (indent + "  ".join(parts)).rstrip()

    out = [line(headers)] if headers else []
    return out + [line(r) for r in rows]


def render_text(title: str, secs: list[Section], heading: str = "autopar plan") -> str:
    """The report for a terminal."""
    lines = [f"{heading}: {title}"]
    for s in secs:
        lines += ["", s.title]
        if s.pairs:
            width = max(len(k) for k, _ in s.pairs)
            lines += [f"  {k:<{width}}  {v}" for k, v in s.pairs]
        if s.rows:
            lines += text_table(s.headers, s.rows, s.numeric)
        lines += [f"  {x}" for x in s.lines]
    return "\n".join(lines) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def md_table(headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset()
             ) -> list[str]:
    """A GitHub-flavoured markdown table."""
    rule = ["---:" if i in numeric else "---" for i in range(len(headers))]
    return ["| " + " | ".join(_md_cell(c) for c in r) + " |"
            for r in (headers, rule, *rows)]


def render_markdown(title: str, secs: list[Section], heading: str = "autopar plan") -> str:
    """The report as markdown (for a pull request, a wiki, an issue)."""
    lines = [f"# {heading}: {title}"]
    for s in secs:
        lines += ["", f"## {s.title}", ""]
        if s.pairs:
            lines += md_table(["", ""], [[f"**{k}**", v] for k, v in s.pairs])
        if s.rows:
            lines += md_table(s.headers, s.rows, s.numeric)
        if s.lines:
            if s.pairs or s.rows:
                lines.append("")
            lines += [f"- {x}" for x in s.lines]
    return "\n".join(lines) + "\n"
