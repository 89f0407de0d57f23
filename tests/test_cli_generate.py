"""`kvpool generate` (issue 15): the reference engine from the command line, its output checked
against transformers' own greedy generation, and its bad input refused in one line."""

import ast
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool.cli.generate import _tiny_model  # noqa: E402
from tests.test_cli_replay import assert_one_line_error, run_cli  # noqa: E402
from tests.test_engine import hf_greedy  # noqa: E402


def outputs(out):
    """The token ids printed for each prompt, and the cached-token count of each."""
    ids = [ast.literal_eval(m) for m in re.findall(r"output token ids: (\[.*\])", out)]
    cached = [int(m) for m in re.findall(r"(\d+) from the cache", out)]
    return ids, cached


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiny_model_generation_matches_transformers(capsys, family):
    prompts = ["the cache holds keys", "the cache holds values"]
    argv = ["generate", "--tiny", family, "--max-new-tokens", "6", "--tokens-per-block", "4"]
    status, out, err = run_cli(capsys, *argv, "--prompt", prompts[0], "--prompt", prompts[1])
    assert status == 0, err
    ids, cached = outputs(out)
    model, _, _ = _tiny_model(family, 0)
    model.generation_config.eos_token_id = None
    for text, tokens in zip(prompts, ids, strict=True):
        assert tokens == hf_greedy(model, list(text.encode()), 6)[0]
    assert cached[0] == 0 and cached[1] >= 16  # the shared "the cache holds " came from the cache
    assert "GPU: quota 256.00 MiB" in out and "suspensions 0" in out
    if family == "gemma3":  # sliding-window and full layers: two pool groups, two slot counts
        assert len(re.findall(r"slots used", out)) == 2


def test_model_directory_and_prompts_file(capsys, tmp_path):
    model, _, _ = _tiny_model("qwen2", 3)
    model.save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    status, out, err = run_cli(
        capsys,
        *["generate", "--model-dir", str(tmp_path / "model"), "--prompts-file", str(prompts)],
        *["--max-new-tokens", "4", "--host", "64MiB"],
    )
    assert status == 0, err
    ids, _ = outputs(out)
    model.generation_config.eos_token_id = None
    assert ids == [
        hf_greedy(model, list(text.encode()), 4)[0] for text in ("first prompt", "second prompt")
    ]
    assert "HOST: quota 64.00 MiB" in out


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--tiny", "llama"], ["no prompt", "--prompt"]),
        (
            ["--tiny", "llama", "--prompts-file", "{tmp}/missing.txt"],
            ["--prompts-file", "missing.txt"],
        ),
        (["--tiny", "llama", "--prompts-file", "{tmp}/empty.txt"], ["no prompt"]),
        (["--model-dir", "{tmp}", "--prompt", "x"], ["--model-dir", "no config.json"]),
        (["--gguf", "{tmp}/model.gguf", "--prompt", "x"], ["--gguf", "no such file"]),
        (["--tiny", "falcon", "--prompt", "x"], ["--tiny", "invalid choice"]),
        (
            ["--tiny", "llama", "--prompt", "x", "--max-new-tokens", "0"],
            ["--max-new-tokens", ">= 1"],
        ),
        (["--tiny", "llama", "--model-dir", "{tmp}", "--prompt", "x"], ["not allowed with"]),
        (["--prompt", "x"], ["one of the arguments", "--tiny"]),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, argv, fragments):
    (tmp_path / "empty.txt").write_text("\n\n")
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    status, _, err = run_cli(capsys, "generate", *argv)
    assert_one_line_error(status, err, *fragments)


def test_unsupported_model_is_refused_by_field(capsys, tmp_path):
    model, config, _ = _tiny_model("llama", 0)
    config.rope_parameters = {"rope_type": "su-per", "rope_theta": 10000.0}
    model.config = config
    model.save_pretrained(tmp_path)
    capsys.readouterr()
    status, _, err = run_cli(capsys, "generate", "--model-dir", str(tmp_path), "--prompt", "x")
    assert_one_line_error(status, err, "rope_type", "su-per")
