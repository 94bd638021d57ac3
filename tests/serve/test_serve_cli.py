"""`python -m nanovllm.serve`'s options: values and combinations it would ignore, or only fail on
after the model loads, are refused before anything starts."""
import socket

import pytest

from nanovllm.serve.__main__ import main, parse_args


@pytest.mark.parametrize("argv,message", [
    (["--max-lora-rank", "64"], "--max-lora-rank needs --enable-lora"),
    (["--max-loras", "2"], "--max-loras needs --enable-lora"),
    (["--max-cpu-loras", "4"], "--max-cpu-loras needs --enable-lora"),
    (["--no-calculate-kv-scales"], "--calculate-kv-scales needs --kv-cache-dtype fp8"),
    (["--lora-modules", "a={dir}"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a={dir}", "a={dir}"], "'a' is already served"),
    (["--enable-lora", "--lora-modules", "/m={dir}"], "'/m' is already served"),
    (["--enable-lora", "--lora-modules", "a={dir}/none"], "no adapter directory"),
    (["--enable-lora", "--lora-modules", "novalue"], "expected name=path"),
    (["--port", "70000"], "--port 70000 is not a port number"),
    (["--port", "-1"], "--port -1 is not a port number"),
    (["--api-key", ""], "--api-key (or $NANOVLLM_API_KEY) '' is empty"),
    (["--served-model-name", " "], "--served-model-name ' ' is empty"),
])
def test_refused_before_the_engine_starts(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["/m", *(arg.format(dir=tmp_path) for arg in argv)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_options_that_need_another_are_kept_with_it(tmp_path):
    args = parse_args(["/m", "--enable-lora", "--max-lora-rank", "64", "--kv-cache-dtype", "fp8",
                       "--no-calculate-kv-scales", "--lora-modules", f"a={tmp_path}"])
    assert (args.max_lora_rank, args.max_loras, args.max_cpu_loras) == (64, None, None)
    assert args.calculate_kv_scales is False
    plain = parse_args(["/m"])  # not given: Config's defaults (FIELD_NEEDS)
    assert (plain.max_lora_rank, plain.max_loras, plain.calculate_kv_scales) == (None,) * 3


def test_a_taken_port_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # No model at this path: only a check made before loading can be the one that fails.
        with pytest.raises(SystemExit, match=f"cannot listen on --host 127.0.0.1 --port {port}"):
            main(["/no/such/model", "--port", str(port), "--device", "cpu"])
