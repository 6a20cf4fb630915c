"""The apps' summaries: a run's figures as a rich table of two columns, on stdout."""

from __future__ import annotations

from typing import Any


def figures_table(title: str, summary: dict[str, Any], rows: list[tuple[str, str]]) -> Any:
    """A rich ``Table`` titled ``title``: the figures every run has (its accuracy, loss, times and
    algorithm, from ``summary``), then ``rows`` (what, value)."""
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    table.add_row("test accuracy", f"{summary['test_accuracy']:.2%}")
    table.add_row("final train loss", f"{summary['final_loss']:.4f}")
    table.add_row("wall time", f"{summary['wall_time_s']:.1f} s (training {summary['train_time_s']:.1f} s)")
    table.add_row("algorithm", summary["algorithm"])
    for what, value in rows:
        table.add_row(what, value)
    return table
