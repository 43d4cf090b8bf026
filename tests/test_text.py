"""What distft prints: counts, and the console that keeps a table's cells whole in a log file."""

import io

from rich.table import Table

from distft.text import FILE_WIDTH, console, plural


def test_counts_take_their_plural():
    assert plural(1, "step") == "1 step" and plural(2, "process") == "2 processes"
    assert plural(12_000, "summary") == "12,000 summaries"


def test_output_to_a_file_keeps_a_wide_tables_cells_whole(monkeypatch):
    """Not a terminal (pytest captures stdout): 120 columns, not rich's 80, so a run's label of
    ~90 characters (eval's `what` column) stays on one line."""
    label = "`micro` preset, random weights + 40 steps of full finetuning on sample + 12 steps of LoRA"
    table = Table("model", "what", "loss")
    table.add_row("finetuned", label, "11.7830")
    out = console(file=io.StringIO())
    assert out.width == FILE_WIDTH
    out.print(table)
    assert any(label in line for line in out.file.getvalue().splitlines())
