"""`kvpool replay` as a user meets it (issue 14): every bad flag is a one-line error before any
work, Ctrl-C stops with a partial report, the output states its setup, JSON repeats a run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import kvpool
from kvpool import KVCacheManagerConfig, _debug
from kvpool.cli import main
from kvpool.replay.driver import ReplayOptions, ReplayStalled, replay
from kvpool.replay.prefix import exact_block_config
from kvpool.replay.workloads import synthetic_conversations
from tests.test_replay import MOONCAKE_SAMPLE, write

SMALL = ["--requests", "16", "--gpu", "128MiB", "--host", "256MiB", "--no-progress"]


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(_debug, "DEBUG", False)  # the CLI's replays are checked elsewhere


def run_cli(capsys, *argv):
    """main(argv) -> (status, stdout, stderr), whether argparse exits or main returns."""
    try:
        status = main(list(argv))
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status, err, *fragments):
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvpool: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--max-batch", "0", ">= 1"),
        ("--max-batch", "-1", ">= 1"),
        ("--prefill-chunk", "0", ">= 1"),
        ("--prefill-chunk", "-10", ">= 1"),
        ("--step-ms", "-5", ">= 0"),
        ("--step-ms", "nan", ">= 0"),
        ("--requests", "0", ">= 1"),
        ("--requests", "-5", ">= 1"),
        ("--tokens-per-block", "0", ">= 1"),
        ("--seed", "-1", ">= 0"),
        ("--rebalance-min-samples", "-2", ">= 0"),
        ("--gpu", "-1GiB", ">= 0"),
        ("--host", "lots", "not a size"),
        ("--capacity-blocks", "0", ">= 1"),
        ("--policy", "default", "invalid choice"),
    ],
)
def test_numeric_flags_are_range_checked_at_parse_time(capsys, flag, value, allowed):
    status, _, err = run_cli(capsys, "replay", flag, value, "--no-progress")
    assert_one_line_error(status, err, flag, allowed)


def test_bad_files_and_paths_are_one_line_errors_before_any_work(capsys, tmp_path):
    rand = tmp_path / "random.jsonl"
    rand.write_bytes(os.urandom(4096))
    listed = write(tmp_path, "list.json", "[]")
    empty = write(tmp_path, "empty.jsonl", "")
    cases = [
        ((str(rand),), "not a text trace"),
        ((empty,), "holds no request"),
        (("--json", str(tmp_path / "missing" / "r.json")), "no such directory"),
        (("--plot", str(tmp_path / "missing" / "r.png")), "no such directory"),
        (("--plot", str(tmp_path / "r.jpg")), ".png, .pdf, .svg"),
        (("--disk", "64MiB", "--disk-path", "/proc"), "--disk-path '/proc': cannot create a file"),
        (("--disk-path", str(tmp_path)), "--disk-path needs --disk"),
        (("--gpu", "100TiB"), "--gpu="),
        (("--hf-config", listed), "--hf-config"),
        (("--hf-config", str(tmp_path)), "a model directory holding one"),
        (("--synthetic", "conversations", empty), "not both"),
        (("--model", "llama-3-8b", "--hf-config", listed), "not both"),
    ]
    if os.geteuid() == 0 or os.access("/sys", os.W_OK):
        cases.append((("--disk", "64MiB", "--disk-path", "/sys"), "--disk-path '/sys'"))
    for argv, fragment in cases:
        status, out, err = run_cli(capsys, "replay", *argv, "--no-progress")
        assert_one_line_error(status, err, fragment)
        assert "requests" not in out  # no work done, no report
    assert not list((tmp_path).glob(".kvpool-*"))


def test_gpu_too_small_names_the_flag_and_a_size_that_fits(capsys):
    status, _, err = run_cli(
        capsys, "replay", "--gpu", "4MiB", "--model", "llama-3-8b", "--no-progress"
    )
    assert_one_line_error(status, err, "--gpu 4.00 MiB is too small", "use --gpu", "GiB or more")
    fits = err.split("use --gpu ")[1].split("GiB")[0]
    status, _, _ = run_cli(
        capsys,
        "replay",
        "--gpu",
        f"{fits}GiB",
        "--model",
        "llama-3-8b",
        "--requests",
        "4",
        "--no-progress",
    )
    assert status == 0


def test_hf_config_fields_are_validated(capsys, tmp_path):
    config = {
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
        "layer_types": ["sliding_attention"] * 31,  # 31 entries for 26 layers
    }
    bad = write(tmp_path, "config.json", json.dumps(config))
    status, _, err = run_cli(capsys, "replay", "--hf-config", bad, "--no-progress")
    assert_one_line_error(status, err, "layer_types", "31 entries", "num_hidden_layers=26")
    config["layer_types"] = ["sliding_attention"] * 25 + ["mamba"]
    write(tmp_path, "config.json", json.dumps(config))
    status, _, err = run_cli(capsys, "replay", "--hf-config", str(tmp_path), "--no-progress")
    assert_one_line_error(status, err, "layer_types[25]='mamba'")
    config["layer_types"] = (["sliding_attention"] * 5 + ["full_attention"]) * 4 + [
        "sliding_attention"
    ] * 2
    write(tmp_path, "config.json", json.dumps(config))
    status, out, _ = run_cli(
        capsys, "info", "--hf-config", str(tmp_path), "--gpu", "64MiB", "--host", "128MiB"
    )
    assert status == 0  # a model directory works, and info takes the replay's memory flags
    assert "layers 0-4,6-10,12-16,18-22,24-25" in out and "1 HOST: quota 128.00 MiB" in out


def test_requests_means_the_first_n(capsys, tmp_path):
    trace = write(tmp_path, "t.jsonl", MOONCAKE_SAMPLE * 3)
    for argv, expected in (
        ((trace, "--requests", "4"), 4),
        ((trace,), 6),
        (("--requests", "10"), 10),
    ):
        json_path = tmp_path / "r.json"
        status, _, err = run_cli(
            capsys, "replay", *argv, "--gpu", "256MiB", "--no-progress", "--json", str(json_path)
        )
        assert status == 0, err
        assert json.loads(json_path.read_text())["report"]["requests"] == expected


def test_stalled_replay_stops_with_a_clear_error():
    workload = synthetic_conversations(num_conversations=2, turns=1, seed=1)
    config = exact_block_config(2, tokens_per_block=16)  # 2 blocks: no prompt fits
    config = KVCacheManagerConfig(16, config.cache_tiers, config.layers)
    with pytest.raises(ReplayStalled, match="no request could make progress for 100 engine steps"):
        replay(workload, config, ReplayOptions(max_batch=4))


def test_options_are_checked_in_the_library_too():
    config = exact_block_config(64, tokens_per_block=16)
    workload = synthetic_conversations(num_conversations=1, turns=1, seed=1)
    for bad in (
        ReplayOptions(max_batch=0),
        ReplayOptions(prefill_chunk=-1),
        ReplayOptions(step_seconds=-1.0),
    ):
        with pytest.raises(Exception, match="is invalid"):
            replay(workload, config, bad)
    with pytest.raises(Exception, match="at least one request"):
        replay([], config)


def test_report_states_setup_latency_and_explains(capsys):
    status, out, _ = run_cli(capsys, "replay", *SMALL, "--explain")
    assert status == 0
    for text in (
        "pool group 0",
        "sliding window 512",
        "full attention",
        "tokens per block",
        "GPU level",
        "HOST level",
        "eviction policy",
        "scheduler",
        "queueing delay",
        "time to first token",
        "recomputed tokens",
    ):
        assert text in out, text
    assert "time to first token:" in out  # the legend


def test_azure_trace_says_it_has_no_prefix_information(capsys, tmp_path):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,4\n2023-11-16 18:15:50.9951690,396,9\n"
    status, out, _ = run_cli(
        capsys, "replay", write(tmp_path, "a.csv", text), "--gpu", "128MiB", "--no-progress"
    )
    assert status == 0 and "carry no prefix information" in out


@pytest.mark.parametrize(
    ("suffix", "magic"), [(".pdf", b"%PDF"), (".svg", b"<?xml"), (".png", b"\x89PNG")]
)
def test_plot_format_follows_the_suffix(capsys, tmp_path, suffix, magic):
    path = tmp_path / f"plot{suffix}"
    status, _, _ = run_cli(capsys, "replay", *SMALL, "--plot", str(path))
    assert status == 0 and path.read_bytes().startswith(magic)
    if suffix == ".svg":
        assert b"<svg" in path.read_bytes()[:2000]


def test_prefix_cache_mode_plots_hit_rate_against_capacity(capsys, tmp_path):
    trace = write(tmp_path, "t.jsonl", MOONCAKE_SAMPLE * 4)
    path = tmp_path / "capacity.svg"
    status, out, _ = run_cli(
        capsys, "replay", trace, "--capacity-blocks", "2", "8", "--plot", str(path), "--no-progress"
    )
    assert status == 0 and "prefix-cache hit rate" in out
    assert b"<svg" in path.read_bytes()[:2000] and b"cache size" in path.read_bytes()


def test_json_records_the_setup_and_repeats_the_run(capsys, tmp_path):
    first = tmp_path / "first.json"
    status, _, _ = run_cli(capsys, "replay", *SMALL, "--seed", "3", "--json", str(first))
    assert status == 0
    data = json.loads(first.read_text())
    assert data["schema"] == 1 and data["kvpool_version"] and data["partial"] is False
    assert data["backend"] == kvpool.backend()
    setup = data["setup"]
    assert (
        setup["seed"] == 3
        and setup["levels"][0]["tier"] == "GPU"
        and setup["levels"][0]["slot_counts"]
    )
    assert setup["flags"]["gpu"] == 128 << 20 and setup["sizes"]["gpu"].startswith(
        "134217728 = 134,217,728 bytes"
    )
    second = tmp_path / "second.json"
    status, _, _ = run_cli(capsys, *setup["argv"], "--no-progress", "--json", str(second))
    assert status == 0
    again = json.loads(second.read_text())
    for key in ("requests", "prompt_tokens", "hit_tokens", "steps", "suspensions", "dropped_pages"):
        assert again["report"][key] == data["report"][key], key
    assert again["setup"]["argv"] == setup["argv"]


def test_sizes_accept_binary_and_decimal_units(capsys):
    status, out, _ = run_cli(capsys, "info", "--gpu", "64MB", "--model", "llama-3-8b")
    assert status == 0 and "quota 61.04 MiB" in out
    status, out, _ = run_cli(capsys, "info", "--gpu", "64MiB", "--model", "llama-3-8b")
    assert status == 0 and "quota 64.00 MiB" in out


def test_help_shows_defaults(capsys):
    status, out, _ = run_cli(capsys, "replay", "--help")
    out = " ".join(out.split())
    assert status == 0
    for default in ("64", "2048", "hazard", "512MiB", "2GiB", "20.0", "32"):
        assert f"(default: {default})" in out, default
    assert "(default: None)" not in out and "(default: False)" not in out


def test_sigint_stops_a_running_replay_with_a_partial_report(tmp_path):
    """A real SIGINT to a replay in a subprocess: partial report, files written, status 130,
    no temporary files left."""
    out_json, out_plot = tmp_path / "r.json", tmp_path / "r.png"
    command = [
        sys.executable, "-m", "kvpool.cli", "replay", "--requests", "3000", "--asap",
        "--gpu", "256MiB", "--host", "0", "--no-progress", "--json", str(out_json),
        "--plot", str(out_plot),
    ]  # fmt: skip
    env = {**os.environ, "KVPOOL_DEBUG": "0"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    time.sleep(6.0)  # start-up, the workload (~1 s), then some hundred steps of a long replay
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "still open" not in err
    assert "partial report" in out and "stopped early" in out
    data = json.loads(out_json.read_text())
    assert data["partial"] is True and data["report"]["steps"] > 0
    assert out_plot.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png"]


def test_verbose_logs_what_the_library_does_and_quiet_does_not(capsys):
    argv = ["replay", "--requests", "120", "--gpu", "128MiB", "--host", "256MiB", "--no-progress"]
    status, _, err = run_cli(capsys, "-v", *argv, "--rebalance-min-samples", "4")
    assert status == 0 and "kvpool: INFO: step" in err and "rebalanced" in err
    status, _, err = run_cli(capsys, "-q", *argv, "--rebalance-min-samples", "4")
    assert status == 0 and err == ""


def test_prefix_cache_mode_compares_policies_side_by_side(capsys, tmp_path):
    trace = write(tmp_path, "t.jsonl", MOONCAKE_SAMPLE * 4)
    path, report = tmp_path / "capacity.svg", tmp_path / "r.json"
    status, _, _ = run_cli(
        capsys, "replay", trace, "--capacity-blocks", "2", "8", "--policy", "lru", "hazard",
        "belady", "--plot", str(path), "--json", str(report), "--no-progress",
    )  # fmt: skip
    assert status == 0
    results = json.loads(report.read_text())["results"]
    assert [(r["policy"], r["capacity_blocks"]) for r in results] == [
        (p, c) for p in ("lru", "hazard", "belady") for c in (2, 8)
    ]
    by = {(r["policy"], r["capacity_blocks"]): r["hit_rate"] for r in results}
    assert all(by["belady", c] >= max(by["lru", c], by["hazard", c]) for c in (2, 8))
    svg = path.read_text()
    assert all(f"<!-- {name} -->" in svg for name in ("lru", "hazard", "belady"))  # legend
    status, _, err = run_cli(capsys, "replay", "--policy", "lru", "lfu", "--no-progress")
    assert_one_line_error(status, err, "several --policy values: only in prefix-cache mode")


def test_prefix_cache_mode_with_host_and_disk_levels_reports_hits_per_level(capsys, tmp_path):
    trace = write(tmp_path, "t.jsonl", MOONCAKE_SAMPLE * 6)
    report = tmp_path / "r.json"
    status, out, _ = run_cli(
        capsys, "replay", trace, "--capacity-blocks", "2", "--tier-ratios", "1", "2",
        "--policy", "lru", "hazard", "belady", "--json", str(report), "--no-progress",
    )  # fmt: skip
    assert status == 0 and "served from" in out and "ceiling (a cache that never evicts)" in out
    results = {r["policy"]: r for r in json.loads(report.read_text())["results"]}
    for policy in ("lru", "hazard"):
        by_tier = results[policy]["hit_tokens_by_tier"]
        assert list(by_tier) == ["GPU", "HOST", "DISK"]
        assert sum(by_tier.values()) == results[policy]["hit_tokens"] > 0
        assert by_tier["HOST"] + by_tier["DISK"] > 0  # the lower levels served some hits
    # The optimum is over the blocks of all levels together (2 + 2 + 4).
    assert results["belady"]["tier_ratios"] == [1, 2]
    assert results["belady"]["hit_rate"] >= results["lru"]["hit_rate"]
    status, _, err = run_cli(capsys, "replay", "--tier-ratios", "1", "2", "--no-progress")
    assert_one_line_error(status, err, "--tier-ratios: only in prefix-cache mode")
