"""Rendering a replay: the summary table (rich), the legend, JSON, and plots (matplotlib; PNG,
PDF or SVG by the file name's suffix)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from kvpool import __version__, backend
from kvpool.replay.driver import ReplayReport

JSON_SCHEMA = 1
"""Version of the `--json` layout (README, "JSON output"); bumped when a field changes meaning."""

LEGEND = {
    "cache-hit tokens": "prompt tokens whose KV was reused from the cache instead of computed "
    "(a block counts at the coldest level one of its pages came from)",
    "concurrency": "requests running in an engine step (peak, and mean over the steps)",
    "suspensions": "running requests paused for want of GPU pages; their pages stay (held) and "
    "may move to colder levels",
    "preemptions": "suspended requests closed to let others progress; they are recomputed later "
    "(their committed blocks stay cached, so only the rest is recomputed)",
    "queueing delay": "simulated time from a request's arrival to its admission",
    "time to first token": "simulated time from arrival to the end of the engine step that "
    "computed the prompt's last token",
    "dropped pages": "cached pages evicted from the last level (their KV is gone, or written "
    "to the remote tier when there is one)",
    "served from REMOTE": "reused tokens fetched from the shared remote tier (written there by "
    "this or another instance when they left its last local level)",
    "moved to": "pages copied into a level by eviction, resume or prefetch (real bytes)",
    "rebalances": "adjust() calls that moved a level's memory between its pool groups",
    "manager time per step": "wall time spent in kvpool calls per engine step (the scheduler "
    "itself does no model compute)",
}


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def setup_rows(setup: dict[str, Any]) -> list[tuple[str, str]]:
    """The simulated setup, as stated at the top of the report."""
    rows = [("workload", setup["workload"]), ("model", setup["model"])]
    for index, name in enumerate(setup["pool_groups"]):
        rows.append((f"  pool group {index}", name))
    rows.append(("tokens per block", f"{setup['tokens_per_block']}"))
    for level in setup["levels"]:
        slots = ", ".join(f"{count:,}" for count in level["slot_counts"])
        rows.append(
            (f"{level['tier']} level", f"{format_bytes(level['quota'])}, slots per group [{slots}]")
        )
    scheduler = setup["scheduler"]
    rows.append(("eviction policy", setup["policy"]))
    rows.append(
        (
            "scheduler",
            f"batch <= {scheduler['max_batch']}, prefill chunk {scheduler['prefill_chunk']}, "
            + (
                "arrivals ignored"
                if scheduler["asap"]
                else f"step {scheduler['step_ms']:g} ms simulated"
            )
            + ("" if scheduler["rebalance"] else ", no rebalancing"),
        )
    )
    return rows


def summary_rows(report: ReplayReport) -> list[tuple[str, str]]:
    requests = f"{report.requests_finished} finished of {report.requests} admitted"
    rows = [
        ("requests", requests + (" (partial: stopped early)" if report.partial else "")),
        ("prompt tokens", f"{report.prompt_tokens:,}"),
        ("cache-hit tokens", f"{report.hit_tokens:,} ({report.hit_rate:.1%})"),
    ]
    for name, hits in zip(report.level_names, report.hit_tokens_by_level, strict=True):
        share = hits / report.prompt_tokens if report.prompt_tokens else 0.0
        rows.append((f"  served from {name}", f"{hits:,} ({share:.1%})"))
    remote = report.remote
    if remote is not None:
        share = report.remote_hit_tokens / report.prompt_tokens if report.prompt_tokens else 0.0
        rows.append(
            ("  served from REMOTE", f"{report.remote_hit_tokens:,} ({share:.1%}, the shared tier)")
        )
        rows.append(
            (
                "remote tier",
                f"{remote['fetched_blocks']:,} blocks fetched, {remote['written_values']:,} "
                f"pages written ({format_bytes(remote['bytes_written'])}), "
                f"{remote['missing_values'] + remote['corrupt_values']:,} gone or bad, "
                f"{remote['errors']:,} failed calls",
            )
        )
        for address, node in report.remote_nodes.items():
            rows.append(
                (
                    f"  node {address}",
                    f"{node['calls']:,.0f} calls ({node['mean_ms']:.2f} ms mean), "
                    f"{node['errors']:,.0f} failed, {node['skipped_calls']:,.0f} skipped, "
                    f"{node['redirects']:,.0f} redirected",
                )
            )
    delay, ttft = report.queueing_delay, report.time_to_first_token
    rows += [
        ("concurrency peak / mean", f"{report.peak_concurrency} / {report.mean_concurrency:.1f}"),
        (
            "queueing delay mean/p50/p99",
            f"{delay.mean:.2f} / {delay.p50:.2f} / {delay.p99:.2f} s",
        ),
        (
            "time to first token mean/p50/p99",
            f"{ttft.mean:.2f} / {ttft.p50:.2f} / {ttft.p99:.2f} s",
        ),
        ("suspensions / preemptions", f"{report.suspensions} / {report.preemptions}"),
        ("  recomputed tokens", f"{report.recomputed_tokens:,}"),
        ("dropped pages", f"{report.dropped_pages:,}"),
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
            f"{report.requests_per_second:,.1f} requests/s ({report.wall_seconds:.1f} s)",
        ),
    ]
    if report.records_verified:
        rows.append(("KV records verified", f"{report.records_verified:,}"))
    return rows


def print_report(
    report: ReplayReport,
    title: str,
    setup: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
    explain: bool = False,
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    if setup is not None:
        for name, value in setup_rows(setup):
            table.add_row(name, value, style="dim")
        table.add_section()
    for name, value in summary_rows(report):
        table.add_row(name, value)
    console = Console()
    console.print(table)
    for note in notes:
        console.print(f"note: {note}")
    if explain:
        for term, meaning in LEGEND.items():
            console.print(f"[bold]{term}[/bold]: {meaning}")


def report_json(
    report: ReplayReport, setup: dict[str, Any], notes: Sequence[str] = ()
) -> dict[str, Any]:
    """The `--json` document: the schema version, kvpool's version and backend, the setup (every flag, so
    that the run can be repeated from the file alone), notes, and every figure."""
    return {
        "schema": JSON_SCHEMA,
        "kvpool_version": __version__,
        "backend": backend(),
        "partial": report.partial,
        "setup": setup,
        "notes": list(notes),
        "report": report.to_dict(),
    }


def write_json(data: dict[str, Any], path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(data, file, indent=2)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def _save(figure: Any, path: str | os.PathLike[str]) -> None:
    suffix = os.path.splitext(os.fspath(path))[1].lower().lstrip(".") or "png"
    figure.savefig(path, format=suffix, dpi=100, bbox_inches="tight")


def write_plot(
    report: ReplayReport, path: str | os.PathLike[str], pool_group_names: Sequence[str] = ()
) -> None:
    """Pool occupancy per level and pool group over engine steps (rebalances marked with their
    level), and the hit rate so far. The format follows the suffix (png, pdf, svg)."""
    pyplot = _pyplot()
    figure, (top, bottom) = pyplot.subplots(2, 1, figsize=(11, 7), sharex=True)
    for key, values in report.occupancy.items():
        level, _, group = key.partition(" pool group ")
        name = (
            pool_group_names[int(group)] if int(group) < len(pool_group_names) else f"group {group}"
        )
        top.plot(report.sample_steps, values, label=f"{level}: {name}")
    styles = ["--", ":", "-."]  # per level
    labelled: set[int] = set()
    for event in report.rebalances:
        top.axvline(
            event.step,
            color="black",
            linestyle=styles[event.level % len(styles)],
            linewidth=0.9,
            label=None
            if event.level in labelled
            else f"rebalance ({report.level_names[event.level]})",
        )
        labelled.add(event.level)
    top.set_ylabel("share of slots in use")
    top.set_ylim(0, 1.05)
    top.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    top.set_title(
        "pool occupancy per level and pool group" + (" (partial)" if report.partial else "")
    )
    bottom.plot(report.sample_steps, report.hit_rate_samples, color="tab:green")
    bottom.set_ylabel("hit rate so far")
    bottom.set_xlabel("engine step")
    bottom.set_ylim(0, 1)
    figure.tight_layout()
    _save(figure, path)
    pyplot.close(figure)


def write_capacity_plot(
    curves: dict[str, list[tuple[int, float]]], path: str | os.PathLike[str]
) -> None:
    """Prefix-cache mode: hit rate against cache size (blocks, log scale), one line per
    policy (`curves`: policy -> (capacity, hit rate) points)."""
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(8, 5))
    for policy, points in curves.items():
        axes.plot([c for c, _ in points], [h for _, h in points], marker="o", label=policy)
    axes.set_xscale("log")
    axes.set_xlabel("cache size (512-token blocks)")
    axes.set_ylabel("prefix hit rate")
    highest = max([h for points in curves.values() for _, h in points] + [0.01])
    axes.set_ylim(0, highest * 1.15)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="upper left")
    axes.set_title("prefix-cache hit rate against cache size")
    figure.tight_layout()
    _save(figure, path)
    pyplot.close(figure)
