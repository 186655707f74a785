"""A port of Go's `text/tabwriter` (left-aligned, space padding), so `inspect` prints what gpushare printed.

gpushare's inspect tool writes through `tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)`: a cell ends at a
tab, a column is the run of consecutive lines that have a tab-terminated cell at that position, and each
cell of a column is padded to the widest cell plus `padding`. Text after a line's last tab is not
aligned. Cells that end a line with a tab are padded too (hence gpushare's trailing spaces).
"""

from __future__ import annotations


def tabwrite(text: str, *, padding: int = 2, minwidth: int = 0) -> str:
    """Align tab-separated `text` exactly as Go's tabwriter with these settings would."""
    lines = [line.split("\t") for line in text.split("\n")]
    widths: list[int] = []
    out: list[str] = []

    def write_lines(line0: int, line1: int) -> None:
        for i in range(line0, line1):
            cells = lines[i]
            for j, cell in enumerate(cells):
                out.append(cell)
                if j < len(widths):
                    out.append(" " * (widths[j] - len(cell)))
            if i + 1 < len(lines):
                out.append("\n")

    def format_block(line0: int, line1: int) -> None:
        column = len(widths)
        this = line0
        while this < line1:
            if column >= len(lines[this]) - 1:
                this += 1
                continue
            write_lines(line0, this)
            line0 = this
            width = minwidth
            while this < line1 and column < len(lines[this]) - 1:
                width = max(width, len(lines[this][column]) + padding)
                this += 1
            widths.append(width)
            format_block(line0, this)
            widths.pop()
            line0 = this
        write_lines(line0, line1)

    format_block(0, len(lines))
    return "".join(out)
