"""LLM(...) fails early with a clear error naming the problem, and leaves nothing behind."""
import json
import multiprocessing
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config, config_from_kwargs
from nanovllm.runner.model_runner import ModelRunner


def copy_checkpoint(src: str, dst: str, drop: tuple[str, ...] = (),
                    config_text: str | None = None) -> str:
    """Copy `src` without files ending in any of `drop`, optionally replacing config.json."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(drop):
            shutil.copy(os.path.join(src, name), dst)
    if config_text is not None:
        with open(os.path.join(dst, "config.json"), "w") as f:
            f.write(config_text)
    return dst


def gpt2_config(src: str) -> str:
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    return json.dumps(config)


def nanovllm_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("nanovllm")}


def assert_fails_cleanly(model: str, kwargs: dict, exc: type, message: str) -> None:
    shm_before = nanovllm_shm()
    with pytest.raises(exc, match=message):
        LLM(model, **kwargs)
    assert multiprocessing.active_children() == []  # no worker left behind
    assert nanovllm_shm() <= shm_before


@pytest.mark.parametrize("kind, message", [
    ("missing", r"model directory '.*/nope' does not exist"),
    ("no_config", r"model directory '.*' has no config.json"),
    ("no_weights", r"model directory '.*' has no \*.safetensors weights"),
    ("no_tokenizer", r"model directory '.*' has no tokenizer: expected one of \['tokenizer.json'"),
    ("bad_json", r"cannot read config.json of '.*'"),
    ("gpt2", r"unsupported architecture \['GPT2LMHeadModel'\] in '.*'; supported: "
             r"\['Qwen3ForCausalLM', 'Qwen3MoeForCausalLM', 'Qwen2ForCausalLM', "
             r"'LlamaForCausalLM', 'MistralForCausalLM'\]"),
])
def test_bad_model_directory(tiny_model, tmp_path, kind, message):
    dst = str(tmp_path / kind)
    model = {
        "missing": lambda: str(tmp_path / "nope"),
        "no_config": lambda: copy_checkpoint(tiny_model, dst, drop=("config.json",)),
        "no_weights": lambda: copy_checkpoint(tiny_model, dst, drop=(".safetensors",)),
        "no_tokenizer": lambda: copy_checkpoint(tiny_model, dst, drop=("tokenizer.json",)),
        "bad_json": lambda: copy_checkpoint(tiny_model, dst, config_text="{not json"),
        "gpt2": lambda: copy_checkpoint(tiny_model, dst, config_text=gpt2_config(tiny_model)),
    }[kind]()
    assert_fails_cleanly(model, {}, ValueError, message)


@pytest.mark.parametrize("kwargs, message", [
    (dict(foo=1), r"unknown argument\(s\) \['foo'\]; LLM accepts \["),
    (dict(max_loras=4), r"max_loras=4 needs enable_lora=True: without it, it would change "),
    (dict(max_lora_rank=8), r"max_lora_rank=8 needs enable_lora=True"),
    (dict(max_cpu_loras=2), r"max_cpu_loras=2 needs enable_lora=True"),
    (dict(calculate_kv_scales=False), r"calculate_kv_scales=False needs kv_cache_dtype='fp8'"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size=0 is invalid: expected an int in "
                                   r"\[1, 8\]"),
    (dict(tensor_parallel_size=9), r"tensor_parallel_size=9 is invalid"),
    (dict(tensor_parallel_size="2"), r"tensor_parallel_size='2' is invalid"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization=0 is invalid: "
                                     r"expected a number in \(0, 1\]"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization=1.5 is invalid"),
    (dict(gpu_memory_utilization=-0.1), r"gpu_memory_utilization=-0.1 is invalid"),
    (dict(gpu_memory_utilization=float("nan")), r"gpu_memory_utilization=nan is invalid"),
    (dict(gpu_memory_utilization="0.5"), r"gpu_memory_utilization='0.5' is invalid"),
    (dict(kvcache_block_size=0), r"kvcache_block_size=0 is invalid: "
                                 r"expected a positive multiple of 256"),
    (dict(kvcache_block_size=128), r"kvcache_block_size=128 is invalid"),
    (dict(kvcache_block_size=257), r"kvcache_block_size=257 is invalid"),
    (dict(kvcache_block_size=-256), r"kvcache_block_size=-256 is invalid"),
    (dict(num_kvcache_blocks=0), r"num_kvcache_blocks=0 is invalid: "
                                 r"expected -1 \(auto\) or an int in \[1, 2147483647\]"),
    (dict(num_kvcache_blocks=-2), r"num_kvcache_blocks=-2 is invalid"),
    (dict(max_model_len=1), r"max_model_len=1 is invalid: expected an int in \[2, 2147483647\]"),
    (dict(max_num_seqs=0), r"max_num_seqs=0 is invalid: expected an int in \[1, 2147483647\]"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens=0 is invalid"),
    (dict(max_model_len=0), r"max_model_len=0 is invalid"),
    (dict(device="tpu"), r"device='tpu' is invalid"),
    (dict(dtype="int8"), r"dtype='int8' is invalid: expected one of \['auto', "),
    (dict(enforce_eager=1), r"enforce_eager=1 is invalid: expected a bool"),
    (dict(load_format="pt"), r"load_format='pt' is invalid: expected one of \['auto', 'dummy'\]"),
    (dict(attention_backend=None), r"attention_backend=None is invalid"),
    (dict(attention_backend="bogus"), r"attention_backend='bogus' is invalid: expected one of "
                                      r"\['auto', 'flash-attn', 'triton', 'torch'\]"),
    # device ranges: counts are int32 on the device
    (dict(max_num_seqs=2**31), r"max_num_seqs=2147483648 is invalid"),
    (dict(max_num_batched_tokens=2**63), r"max_num_batched_tokens=9223372036854775808 is inv"),
    (dict(num_kvcache_blocks=2**40), r"num_kvcache_blocks=1099511627776 is invalid"),
    (dict(gpu_memory_utilization=float("inf")), r"gpu_memory_utilization=inf is invalid"),
    (dict(max_num_seqs=True), r"max_num_seqs=True is invalid"),
])
def test_bad_keyword(tiny_model, kwargs, message):
    assert_fails_cleanly(tiny_model, kwargs, ValueError, message)


def test_dummy_weights_need_no_safetensors(tiny_model, tmp_path):
    """load_format='dummy': config.json and a tokenizer are enough."""
    path = copy_checkpoint(tiny_model, str(tmp_path / "dummy"), drop=(".safetensors",))
    llm = LLM(path, load_format="dummy", num_kvcache_blocks=4)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0]["token_ids"]) == 3
    llm.shutdown()


def test_any_token_budget_with_any_max_model_len(tiny_model):
    """A budget below max_model_len is valid (long prompts are prefilled in chunks); the
    default max_model_len is the checkpoint's limit, and a larger one is refused (as vLLM)."""
    config = Config(tiny_model, max_num_batched_tokens=1, max_num_seqs=512)
    assert (config.max_num_batched_tokens, config.max_model_len) == (1, 4096)
    with pytest.raises(ValueError, match=r"max_model_len=4097 exceeds this checkpoint's "
                                         r"max_position_embeddings=4096"):
        Config(tiny_model, max_model_len=4097)
    assert Config(tiny_model, max_model_len=4096).max_model_len == 4096
    assert Config(tiny_model, max_model_len=300).max_model_len == 300


def test_kv_pool_that_would_be_empty(tiny_model, monkeypatch):
    """The CUDA sizing formula on faked memory figures: nothing left for the KV cache."""
    config = Config(tiny_model, device="cpu", gpu_memory_utilization=0.5)
    config.device = "cuda"  # only allocate_kv_cache's arithmetic runs; memory is faked below
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 8 * gib))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {
        "allocated_bytes.all.peak": 3 * gib, "allocated_bytes.all.current": gib})
    runner = SimpleNamespace(config=config, block_size=256, world_size=1,
                             device=torch.device("cpu"), block_bytes=lambda: 1 << 20)
    # budget = 8 GiB * 0.5 - (8 - 2) GiB used - 3 GiB peak + 1 GiB current < 0
    with pytest.raises(RuntimeError, match=r"no room for the KV cache: one block needs 1048576 "
                                           r"bytes; raise gpu_memory_utilization=0.5"):
        ModelRunner.allocate_kv_cache(runner)


@pytest.mark.gpu
def test_kv_pool_that_would_be_empty_on_gpu(tiny_model):
    assert_fails_cleanly(tiny_model, dict(gpu_memory_utilization=1e-3), RuntimeError,
                         r"no room for the KV cache")
    torch.cuda.empty_cache()


def test_bad_attention_backend_fails_before_anything_loads(tmp_path):
    # The model directory does not exist: the backend name is checked before it is even read.
    assert_fails_cleanly(str(tmp_path / "nope"), dict(attention_backend="bogus"), ValueError,
                         r"attention_backend='bogus' is invalid")


def test_fields_that_need_another_take_their_defaults(tiny_model):
    """Not given, FIELD_NEEDS' fields take their defaults, whatever they need."""
    plain = config_from_kwargs(tiny_model, {})
    assert (plain.max_loras, plain.max_lora_rank, plain.max_cpu_loras,
            plain.calculate_kv_scales) == (1, 16, 1, True)
    given = config_from_kwargs(tiny_model, dict(enable_lora=True, max_loras=2,
                                                kv_cache_dtype="fp8", calculate_kv_scales=False))
    assert (given.max_loras, given.max_cpu_loras, given.calculate_kv_scales) == (2, 2, False)


def _split_tokenizer(src: str, tmp_path) -> tuple[str, str]:
    """(src's weights and config without its tokenizer files, a directory of those files)."""
    weights, tokenizer = tmp_path / "weights", tmp_path / "tokenizer"
    weights.mkdir()
    tokenizer.mkdir()
    for name in os.listdir(src):
        is_tokenizer = name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab",
                                        "merges"))
        shutil.copy(os.path.join(src, name), tokenizer if is_tokenizer else weights)
    return str(weights), str(tokenizer)


def test_tokenizer_from_another_directory(tiny_model, tmp_path):
    """tokenizer=DIR (vLLM's name): a checkpoint without tokenizer files runs with one from
    elsewhere, the same tokens and text as the whole checkpoint; get_tokenizer() is the one
    used, and the server takes it as --tokenizer."""
    from nanovllm.serve.__main__ import parse_args
    weights, tokenizer = _split_tokenizer(tiny_model, tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    whole = LLM(tiny_model, num_kvcache_blocks=8)
    expected = whole.generate(["hello there"], greedy, use_tqdm=False)[0]
    ids = whole.get_tokenizer().encode("hello there")
    whole.shutdown()
    with pytest.raises(ValueError, match=r"model directory '.*weights' has no tokenizer: "
                                         r".*\(or pass tokenizer=DIR\)"):
        LLM(weights)
    llm = LLM(weights, tokenizer=tokenizer, num_kvcache_blocks=8)
    assert llm.config.tokenizer == tokenizer and llm.get_tokenizer() is llm.tokenizer
    out = llm.generate(["hello there"], greedy, use_tqdm=False)[0]
    assert (out["token_ids"], out["text"]) == (expected["token_ids"], expected["text"])
    assert llm.get_tokenizer().encode("hello there") == ids
    llm.shutdown()
    assert parse_args([weights, "--tokenizer", tokenizer]).tokenizer == tokenizer


@pytest.mark.parametrize("tokenizer, message", [
    ("nope", r"tokenizer directory '.*nope' does not exist"),
    ("empty", r"tokenizer directory '.*empty' has no tokenizer: expected one of "
              r"\['tokenizer.json'"),
    (3, r"tokenizer=3 is invalid: expected a directory path or None"),
])
def test_bad_tokenizer_directory(tiny_model, tmp_path, tokenizer, message):
    if isinstance(tokenizer, str):
        tokenizer = str(tmp_path / tokenizer)
        if tokenizer.endswith("empty"):
            os.makedirs(tokenizer)
    assert_fails_cleanly(tiny_model, dict(tokenizer=tokenizer), ValueError, message)
