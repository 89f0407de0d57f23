"""Rendering a replay: the summary table (rich), JSON, and the occupancy plot (matplotlib)."""

from __future__ import annotations

import json
import os
from typing import Any

from kvpool.replay.driver import ReplayReport


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def summary_rows(report: ReplayReport) -> list[tuple[str, str]]:
    rows = [
        ("requests", f"{report.requests}"),
        ("prompt tokens", f"{report.prompt_tokens:,}"),
        ("cache-hit tokens", f"{report.hit_tokens:,} ({report.hit_rate:.1%})"),
    ]
    for name, hits in zip(report.level_names, report.hit_tokens_by_level, strict=True):
        share = hits / report.prompt_tokens if report.prompt_tokens else 0.0
        rows.append((f"  served from {name}", f"{hits:,} ({share:.1%})"))
    rows += [
        ("concurrency peak / mean", f"{report.peak_concurrency} / {report.mean_concurrency:.1f}"),
        ("suspensions / preemptions", f"{report.suspensions} / {report.preemptions}"),
        ("evicted (dropped) pages", f"{report.dropped_pages:,}"),
    ]
    for name, pages, moved in zip(
        report.level_names, report.pages_moved_to_level, report.bytes_moved_to_level, strict=True
    ):
        if pages:
            rows.append((f"  moved to {name}", f"{pages:,} pages, {format_bytes(moved)}"))
    rows.append(("rebalances", f"{len(report.rebalances)}"))
    for event in report.rebalances:
        before = ", ".join(f"{r:.0%}" for r in event.before)
        after = ", ".join(f"{r:.0%}" for r in event.after)
        rows.append(
            (f"  step {event.step}, {report.level_names[event.level]}", f"[{before}] -> [{after}]")
        )
    rows += [
        (
            "manager time per step",
            f"mean {report.manager_us_per_step_mean:.0f} us, p99 {report.manager_us_per_step_p99:.0f} us",
        ),
        ("engine steps", f"{report.steps:,} ({report.simulated_seconds:.1f} s simulated)"),
        (
            "replay speed",
            f"{report.requests_per_second:,.0f} requests/s ({report.wall_seconds:.1f} s)",
        ),
    ]
    if report.records_verified:
        rows.append(("KV records verified", f"{report.records_verified:,}"))
    return rows


def print_report(report: ReplayReport, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    for name, value in summary_rows(report):
        table.add_row(name, value)
    Console().print(table)


def write_json(
    report: ReplayReport, path: str | os.PathLike[str], extra: dict[str, Any] | None = None
) -> None:
    data = {**report.to_dict(), **(extra or {})}
    with open(path, "w", encoding="utf-8") as file:
        json.dump(data, file, indent=2)


def write_plot(report: ReplayReport, path: str | os.PathLike[str]) -> None:
    """Pool occupancy per pool group and level over engine steps (rebalances marked), and the
    hit rate so far."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (top, bottom) = pyplot.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, values in report.occupancy.items():
        top.plot(report.sample_steps, values, label=name)
    for event in report.rebalances:
        top.axvline(event.step, color="gray", linestyle="--", linewidth=0.8)
    top.set_ylabel("slots in use")
    top.set_ylim(0, 1.05)
    top.legend(fontsize="small", loc="lower right")
    top.set_title("pool occupancy (dashed: rebalances)")
    bottom.plot(report.sample_steps, report.hit_rate_samples, color="tab:green")
    bottom.set_ylabel("hit rate so far")
    bottom.set_xlabel("engine step")
    bottom.set_ylim(0, 1)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    pyplot.close(figure)
