"""`pyorch serve` flags: parsing, --config files, refusals (no server started)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pyorch.entrypoints.openai import cli_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pyorch-serve")
    cli_args.add_cli_args(parser)
    return parser.parse_args(argv)


def test_defaults_map_to_engine_args():
    args = parse([])
    engine_args = cli_args.engine_args_from(args)
    assert engine_args.model is None  # the embedded default model
    assert engine_args.enable_prefix_caching and engine_args.enable_chunked_prefill
    assert engine_args.tensor_parallel_size == 1 and engine_args.device == "auto"
    assert cli_args.served_model_names(args) == [cli_args.DEFAULT_MODEL_NAME]
    assert (args.host, args.port, args.allowed_origins) == ("0.0.0.0", 8000, ["*"])


def test_flags_map_to_engine_args():
    args = parse(["/m/qwen", "--dtype", "bfloat16", "--max-model-len", "32k",
                  "--kv-cache-memory-bytes", "2GiB", "--block-size", "32",
                  "--max-num-seqs", "8", "--max-num-batched-tokens", "1K",
                  "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--seed", "3",
                  "--load-format", "dummy", "--enforce-eager", "--gpu-memory-utilization", "0.5"])
    e = cli_args.engine_args_from(args)
    assert (e.model, e.dtype, e.max_model_len, e.kv_cache_memory_bytes) == \
        ("/m/qwen", "bfloat16", 32000, 2 << 30)
    assert (e.block_size, e.max_num_seqs, e.max_num_batched_tokens) == (32, 8, 1024)
    assert not e.enable_prefix_caching and not e.enable_chunked_prefill
    assert (e.seed, e.load_format, e.enforce_eager, e.gpu_memory_utilization) == \
        (3, "dummy", True, 0.5)
    assert cli_args.served_model_names(args) == ["/m/qwen"]
    assert parse(["--max-model-len", "auto"]).max_model_len is None


def test_pooling_flags_map_to_engine_args(tmp_path):
    e = cli_args.engine_args_from(parse(["--runner", "pooling", "--convert", "embed",
                                         "--pooler-config", '{"pooling_type": "MEAN"}']))
    assert (e.runner, e.convert, e.pooler_config) == ("pooling", "embed",
                                                      {"pooling_type": "MEAN"})
    assert cli_args.engine_args_from(parse([])).runner == "auto"
    config = tmp_path / "serve.yaml"
    config.write_text("runner: pooling\npooler-config: {pooling_type: CLS, normalize: false}\n")
    e = cli_args.engine_args_from(parse(["--config", str(config)]))
    assert e.runner == "pooling" and e.pooler_config == {"pooling_type": "CLS",
                                                         "normalize": False}


@pytest.mark.parametrize("text, value", [("4096", 4096), ("1k", 1000), ("1K", 1024),
                                         ("256MiB", 256 << 20), ("2G", 2 << 30),
                                         ("1.5k", 1500)])
def test_human_int(text, value):
    assert cli_args.human_int(text) == value


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "2"], "cannot be served yet"),
    (["-tp", "4"], "cannot be served yet"),
    (["--pipeline-parallel-size", "2"], "cannot be served yet"),
    (["--max-model-len", "lots"], "expected an integer"),
    (["--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["--block-size", "3"], "invalid choice"),
    (["--runner", "draft"], "invalid choice"),
    (["--pooler-config", "[1]"], "expected a JSON object"),
])
def test_bad_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_file_and_command_line_precedence(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("port: 9001\nmax_model_len: 1024\nserved-model-name: [a, b]\n"
                      "enable_prefix_caching: false\nallowed-origins: ['http://x']\n"
                      "disable-log-requests: true\nmodel: /from/file\n")
    args = parse(["--config", str(config), "--port", "9002"])
    assert args.port == 9002  # the command line wins
    assert args.max_model_len == 1024 and args.served_model_name == ["a", "b"]
    assert args.enable_prefix_caching is False and args.allowed_origins == ["http://x"]
    assert args.disable_log_requests is True
    assert cli_args.engine_args_from(args).model == "/from/file"
    # A positional MODEL is not swallowed by a list flag from the file, and wins over it.
    args = parse(["/cli/model", "--config", str(config)])
    assert args.served_model_name == ["a", "b"]
    assert cli_args.engine_args_from(args).model == "/cli/model"


def test_config_file_errors(tmp_path, capsys):
    bad_key = tmp_path / "bad.yaml"
    bad_key.write_text("no-such-flag: 1\n")
    not_a_map = tmp_path / "list.yaml"
    not_a_map.write_text("- 1\n- 2\n")
    for path, message in ((bad_key, "unknown key 'no-such-flag'"), (not_a_map, "mapping"),
                          (tmp_path / "missing.yaml", "cannot read")):
        with pytest.raises(SystemExit) as info:
            parse(["--config", str(path)])
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_pyorch_serve_dispatcher_help_groups_and_tp_refusal():
    """Through the real dispatcher (`pyorch serve`), in a subprocess as users run it."""
    run = [sys.executable, "-m", "pyorch.cli.main", "serve"]
    help_text = subprocess.run(run + ["--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0, help_text.stderr
    for group in ("server:", "model:", "cache:", "scheduler:", "parallel:"):
        assert group in help_text.stdout
    for flag in ("--api-key", "--served-model-name", "--chat-template", "--allowed-origins",
                 "--root-path", "--uvicorn-log-level", "--config", "--enable-prefix-caching"):
        assert flag in help_text.stdout
    refused = subprocess.run(run + ["-tp", "2"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "tensor-parallel-size=2 cannot be served yet" in refused.stderr
