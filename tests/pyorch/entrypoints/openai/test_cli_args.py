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
    # vLLM 0.26's default (CacheConfig.gpu_memory_utilization = 0.92), the same for the server,
    # EngineArgs (LLM()) and the engine's CacheConfig.
    from pyorch.config import CacheConfig
    from pyorch.engine.arg_utils import EngineArgs
    assert engine_args.gpu_memory_utilization == EngineArgs().gpu_memory_utilization == \
        CacheConfig().gpu_memory_utilization == 0.92


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


def test_disable_cascade_attn_maps_to_engine_args():
    assert cli_args.engine_args_from(parse([])).disable_cascade_attn is False
    e = cli_args.engine_args_from(parse(["--disable-cascade-attn"]))
    assert e.disable_cascade_attn is True  # the engine's use: test_llm's cascade test


def test_quantization_flag_maps_to_engine_args():
    assert cli_args.engine_args_from(parse([])).quantization is None  # the checkpoint's
    assert cli_args.engine_args_from(parse(["-q", "fp8"])).quantization == "fp8"
    e = cli_args.engine_args_from(parse(["--quantization", "compressed-tensors"]))
    assert e.quantization == "compressed-tensors"


def test_scheduling_flags_map_to_engine_args():
    from pyorch.engine.arg_utils import SERVE_TARGET_STEP_MS, EngineArgs

    e = cli_args.engine_args_from(parse([]))
    assert e.target_step_ms == "auto"  # the server sizes steps by time on CUDA
    assert e._target_step_ms("cuda") == SERVE_TARGET_STEP_MS and e._target_step_ms("cpu") is None
    assert (e.long_prefill_token_threshold, e.max_num_partial_prefills,
            e.max_long_partial_prefills) == (0, 1, 1)
    e = cli_args.engine_args_from(parse(["--target-step-ms", "25", "--scheduling-policy",
                                         "priority", "--long-prefill-token-threshold", "2k",
                                         "--max-num-partial-prefills", "4",
                                         "--max-long-partial-prefills", "2"]))
    assert e._target_step_ms("cpu") == 25.0 and e.scheduling_policy == "priority"
    assert (e.long_prefill_token_threshold, e.max_num_partial_prefills,
            e.max_long_partial_prefills) == (2000, 4, 2)
    assert cli_args.engine_args_from(parse(["--target-step-ms", "0"]))._target_step_ms(
        "cuda") is None
    assert EngineArgs()._target_step_ms("cuda") is None  # offline LLM keeps the fixed budget


def test_server_gets_vllms_api_server_batch_defaults(monkeypatch):
    """pyorch-serve sizes max_num_batched_tokens / max_num_seqs as vLLM's API server does
    (8192 / 1024 on a >= 70 GiB GPU, 2048 / 128 on the CPU); the offline LLM class keeps the
    larger LLM-class defaults (16384 / 1024, 4096 / 256); usage_context is no LLM() kwarg."""
    import torch

    from pyorch.engine.arg_utils import EngineArgs

    served = cli_args.engine_args_from(parse([]))
    assert served.usage_context == "openai_api_server"
    assert served._default_batch_sizes("cpu") == (2048, 128)
    assert EngineArgs()._default_batch_sizes("cpu") == (4096, 256)

    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    assert served._default_batch_sizes("cuda") == (8192, 1024)
    assert EngineArgs()._default_batch_sizes("cuda") == (16384, 1024)
    Props.total_memory = 40 * 2**30
    assert served._default_batch_sizes("cuda") == (2048, 256)
    assert "usage_context" not in EngineArgs.field_names()
    from pyorch import LLM

    with pytest.raises(TypeError, match="usage_context"):
        LLM(usage_context="openai_api_server")
    with pytest.raises(ValueError, match="usage_context"):
        EngineArgs(usage_context="bogus")._default_batch_sizes("cpu")


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


def test_parallel_flags_map_to_engine_args():
    e = cli_args.engine_args_from(parse(["-tp", "2", "--distributed-executor-backend", "ray",
                                         "--disable-custom-all-reduce"]))
    assert (e.tensor_parallel_size, e.distributed_executor_backend) == (2, "ray")
    assert e.disable_custom_all_reduce is True
    e = cli_args.engine_args_from(parse(["--tensor-parallel-size", "4"]))
    assert (e.tensor_parallel_size, e.distributed_executor_backend) == (4, None)
    assert e.disable_custom_all_reduce is False
    assert (e.enable_expert_parallel, e.expert_placement_strategy) == (False, "linear")
    e = cli_args.engine_args_from(parse(["-tp", "4", "--enable-expert-parallel",
                                         "--expert-placement-strategy", "round_robin"]))
    assert (e.enable_expert_parallel, e.expert_placement_strategy) == (True, "round_robin")
    e = cli_args.engine_args_from(parse(["--no-enable-expert-parallel"]))
    assert e.enable_expert_parallel is False


@pytest.mark.parametrize("argv, message", [
    (["-tp", "0"], "must be >= 1"),
    (["--pipeline-parallel-size", "2"], "tensor parallelism only"),
    (["--distributed-executor-backend", "external_launcher"], "invalid choice"),
    (["--expert-placement-strategy", "striped"], "invalid choice"),
    (["--max-model-len", "lots"], "expected an integer"),
    (["--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["--block-size", "3"], "invalid choice"),
    (["--tool-call-parser", "pythonic"], "invalid choice"),
    (["--reasoning-parser", "granite"], "invalid choice"),
    (["--target-step-ms", "fast"], "expected milliseconds"),
    (["--target-step-ms", "-5"], "expected milliseconds >= 0"),
    (["--max-num-partial-prefills", "0"], "must be >= 1"),
    (["--long-prefill-token-threshold", "-1"], "expected an integer"),
    (["--runner", "draft"], "invalid choice"),
    (["--pooler-config", "[1]"], "expected a JSON object"),
])
def test_bad_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_tool_and_reasoning_flags(capsys):
    args = parse(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                  "--reasoning-parser", "deepseek_r1", "--exclude-tools-when-tool-choice-none"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser,
            args.exclude_tools_when_tool_choice_none) == (True, "llama3_json", "deepseek_r1",
                                                          True)
    cli_args.check_tool_args(args)
    defaults = parse([])
    assert (defaults.enable_auto_tool_choice, defaults.tool_call_parser,
            defaults.reasoning_parser) == (False, None, None)
    # vLLM's start-up check: auto tool choice without a parser is refused before any loading.
    assert cli_args.main(parse(["--enable-auto-tool-choice"])) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


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


def test_pyorch_serve_dispatcher_help_groups_and_pp_refusal():
    """Through the real dispatcher (`pyorch serve`), in a subprocess as users run it."""
    run = [sys.executable, "-m", "pyorch.cli.main", "serve"]
    help_text = subprocess.run(run + ["--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0, help_text.stderr
    for group in ("server:", "model:", "cache:", "scheduler:", "parallel:"):
        assert group in help_text.stdout
    for flag in ("--api-key", "--served-model-name", "--chat-template", "--allowed-origins",
                 "--root-path", "--uvicorn-log-level", "--config", "--enable-prefix-caching"):
        assert flag in help_text.stdout
    for flag in ("--tensor-parallel-size", "--distributed-executor-backend",
                 "--disable-custom-all-reduce"):
        assert flag in help_text.stdout
    refused = subprocess.run(run + ["-pp", "2"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "pipeline-parallel-size=2 cannot be served" in refused.stderr


def test_vllm_flags_map_to_engine_args():
    args = parse(["--max-logprobs", "-1", "--generation-config", "vllm",
                  "--override-generation-config", '{"temperature": 0.2}',
                  "--tokenizer-mode", "hf", "--download-dir", "/cache",
                  "--cudagraph-capture-sizes", "1", "2", "8"])
    e = cli_args.engine_args_from(args)
    assert (e.max_logprobs, e.generation_config, e.override_generation_config) == \
        (-1, "vllm", {"temperature": 0.2})
    assert (e.tokenizer_mode, e.download_dir, e.cuda_graph_sizes) == ("hf", "/cache", [1, 2, 8])
    defaults = parse([])
    assert (defaults.response_role, defaults.chat_template_content_format,
            defaults.metrics_prefix) == ("assistant", "auto", "pyorch")
    assert cli_args.engine_args_from(defaults).max_logprobs == 20


@pytest.mark.parametrize("argv, message", [
    (["--max-logprobs", "-2"], "expected an integer >= 0 or -1"),
    (["--override-generation-config", "[1]"], "expected a JSON object"),
    (["--tokenizer-mode", "mistral"], "invalid choice"),
    (["--metrics-prefix", "sglang"], "invalid choice"),
    (["--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype: invalid choice: 'fp8_e5m2'"),
])
def test_bad_vllm_flag_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--enable-lora"], "--enable-lora: LoRA adapters is not supported by pyorch"),
    (["--lora-modules", "a=/x"], "--lora-modules a=/x: LoRA adapters"),
    (["-dp", "2"], "--data-parallel-size 2: data parallelism"),
    (["--swap-space", "8"], "swapping KV blocks to CPU memory"),
    (["--speculative-config", '{"method": "ngram"}'], "speculative decoding"),
    (["--logprobs-mode", "processed_logits"], "(or give --logprobs-mode 'raw_logprobs')"),
    (["--cpu-offload-gb", "4"], "weight offloading"),
    (["--allow-deprecated-quantization"], "deprecated quantization methods"),
    (["--tool-parser-plugin", "p.py"], "tool-parser plugins"),
    (["--enable-expert-parallel", "--all2all-backend", "deepep_low_latency"],
     "--all2all-backend deepep_low_latency: all-to-all expert dispatch"),
])
def test_refused_flags_name_the_flag_and_feature(argv, message):
    from pyorch.entrypoints.openai.cli_refused import refusal

    assert message in (refusal(parse(argv)) or "")


def test_neutral_values_of_refused_flags_are_accepted(tmp_path):
    from pyorch.entrypoints.openai.cli_refused import refusal

    argv = ["-dp", "1", "--logprobs-mode", "raw_logprobs", "--model-impl", "vllm",
            "--cpu-offload-gb", "0", "--stream-interval", "1", "--disable-cascade-attn",
            "--all2all-backend", "allgather_reducescatter"]
    assert refusal(parse(argv)) is None
    config = tmp_path / "serve.yaml"
    config.write_text("enable-lora: true\ndata_parallel_size: 1\n")
    assert "--enable-lora" in (refusal(parse(["--config", str(config)])) or "")


def test_refused_flag_exits_before_loading_through_the_dispatcher():
    run = [sys.executable, "-m", "pyorch.cli.main", "serve"]
    refused = subprocess.run(run + ["--enable-lora", "--max-loras", "4"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2
    assert "pyorch serve: error: --enable-lora: LoRA adapters" in refused.stderr
    assert "unrecognized arguments" not in refused.stderr
    help_text = subprocess.run(run + ["--help"], capture_output=True, text=True, timeout=60)
    assert "not supported:" in help_text.stdout and "--speculative-config" in help_text.stdout


def test_kv_cache_dtype_flag():
    from pyorch.config import KV_CACHE_DTYPES

    for value in KV_CACHE_DTYPES:  # the flag's choices are the engine's
        assert cli_args.engine_args_from(parse(["--kv-cache-dtype", value])).kv_cache_dtype == value
    e = cli_args.engine_args_from(parse(["--kv-cache-dtype", "fp8"]))
    assert e.create_engine_config().cache_config.cache_dtype == "fp8"


@pytest.mark.parametrize("config, message", [
    ('{"backend": "guidance"}', "backend 'guidance' is not supported by pyorch"),
    ('{"backend": "nope"}', "backend must be one of"),
    ('{"disable_additional_properties": true}', "only supported for the guidance backend"),
    ('{"reasoning_parser_plugin": "p.py"}', "reasoning_parser_plugin"),
    ('{"reasoning_parser": "nope"}', "reasoning_parser 'nope' is not one of"),
    ('{"reasoning_parser": "qwen3", "enable_in_reasoning": false}', "enable_in_reasoning false"),
    ('{"disable_any_whitespace": "yes"}', "disable_any_whitespace must be true or false"),
    ('{"bakend": "auto"}', "unknown keys ['bakend']"),
])
def test_structured_outputs_config_refusals_name_the_key(config, message):
    from pyorch.entrypoints.openai.cli_args import check_tool_args

    with pytest.raises(ValueError, match="--structured-outputs-config") as info:
        check_tool_args(parse(["--structured-outputs-config", config]))
    assert message in str(info.value)
    with pytest.raises(ValueError, match="contradicts --reasoning-parser"):
        check_tool_args(parse(["--reasoning-parser", "deepseek_r1", "--structured-outputs-config",
                               '{"reasoning_parser": "qwen3"}']))


def test_structured_outputs_config_applies():
    from pyorch.entrypoints.openai.cli_args import check_tool_args

    args = parse(["--structured-outputs-config", '{"backend": "xgrammar", '
                  '"disable_any_whitespace": true, "reasoning_parser": "qwen3", '
                  '"enable_in_reasoning": true}'])
    check_tool_args(args)
    assert args.structured_outputs_disable_any_whitespace is True
    assert args.reasoning_parser == "qwen3"
    args = parse(["--structured-outputs-config", '{"backend": "auto"}'])
    check_tool_args(args)
    assert args.structured_outputs_disable_any_whitespace is False
    assert args.reasoning_parser is None


def test_request_logging_flags_follow_vllm():
    from pyorch.entrypoints.openai.api_server import make_server_context
    from pyorch.entrypoints.openai.cli_refused import refusal

    assert parse([]).enable_log_requests is False and parse([]).max_log_len is None
    args = parse(["--enable-log-requests", "--max-log-len", "1k"])
    assert refusal(args) is None  # --max-log-len is implemented, no longer refused
    assert (args.enable_log_requests, args.max_log_len) == (True, 1000)
    engine = argparse.Namespace(
        model_config=argparse.Namespace(max_model_len=64, vocab_size=100, max_logprobs=20,
                                        get_diff_sampling_param=dict),
        get_tokenizer=lambda: None, input_processor=argparse.Namespace(chars_per_token=None))
    for argv, logged, limit in (([], False, None), (["--enable-log-requests"], True, None),
                                (["--enable-log-requests", "--max-log-len", "9"], True, 9)):
        ctx = make_server_context(parse(argv), engine, ["m"], None, None)
        assert (ctx.log_requests, ctx.max_log_len) == (logged, limit)
    with pytest.raises(SystemExit):
        parse(["--max-log-len", "-1"])
