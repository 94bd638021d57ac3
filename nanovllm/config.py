"""Engine configuration: one dataclass, validated once at construction."""
import os
from dataclasses import dataclass, field, fields

import torch
from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Qwen3Config's defaults for the fields the model reads, for a config.json that leaves them out.
QWEN3_DEFAULTS = dict(head_dim=128, hidden_act="silu", max_position_embeddings=32768,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                      num_key_value_heads=32)  # 32 when absent, as Qwen3Config; null: MHA
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "vocab_size")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Config:
    """Everything LLM(model, **kwargs) accepts; values discovered at run time live elsewhere."""

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    device: str = "auto"
    dtype: str = "auto"
    logprobs_mode: str = "raw"  # "raw": log_softmax(logits); "processed": what was sampled from
    hf_config: PretrainedConfig = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        self.model = os.path.expanduser(str(self.model))
        self._check_ranges()
        self.hf_config = load_hf_config(self.model)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        if self.max_num_batched_tokens < self.max_model_len:
            # A prompt may be up to max_model_len - 1 tokens and is prefilled in one step.
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} so that any prompt fits in one prefill step")
        self.device = resolve_device(self.device)
        check_tensor_parallel(self.tensor_parallel_size, self.device, self.hf_config)
        self.torch_dtype = resolve_dtype(self.dtype, self.device, self.hf_config)

    def _check_ranges(self) -> None:
        def check(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected {allowed}")

        # Type first, so that a wrong type is reported here and not as a failed comparison.
        def is_int(name: str) -> bool:
            value = getattr(self, name)
            return isinstance(value, int) and not isinstance(value, bool)

        check("max_num_batched_tokens", is_int("max_num_batched_tokens")
              and self.max_num_batched_tokens >= 1, "an int >= 1")
        check("max_num_seqs", is_int("max_num_seqs") and self.max_num_seqs >= 1, "an int >= 1")
        check("max_model_len", is_int("max_model_len") and self.max_model_len >= 2, "an int >= 2")
        utilization = self.gpu_memory_utilization
        check("gpu_memory_utilization", isinstance(utilization, int | float)
              and not isinstance(utilization, bool) and 0 < utilization <= 1,
              "a float in (0, 1]")
        check("tensor_parallel_size", is_int("tensor_parallel_size")
              and 1 <= self.tensor_parallel_size <= 8, "an int in 1..8")
        check("kvcache_block_size", is_int("kvcache_block_size")
              and self.kvcache_block_size > 0 and self.kvcache_block_size % 256 == 0,
              "a positive multiple of 256")
        check("num_kvcache_blocks", is_int("num_kvcache_blocks")
              and (self.num_kvcache_blocks == -1 or self.num_kvcache_blocks > 0),
              "-1 (auto) or a positive int")
        check("device", self.device in ("auto", "cpu", "cuda"), "'auto', 'cpu' or 'cuda'")
        check("dtype", self.dtype in ("auto", *_DTYPES), f"'auto' or one of {sorted(_DTYPES)}")
        check("enforce_eager", isinstance(self.enforce_eager, bool), "a bool")
        check("logprobs_mode", self.logprobs_mode in ("raw", "processed"),
              "'raw' or 'processed'")


def config_from_kwargs(model: str, kwargs: dict) -> Config:
    """Build a Config, naming any keyword it does not know."""
    names = {f.name for f in fields(Config) if f.init}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; LLM accepts {sorted(names - {'model'})}")
    return Config(model, **kwargs)


def load_hf_config(model: str) -> PretrainedConfig:
    """Check the model directory and read its config.json, with errors that name the problem."""
    if not os.path.isdir(model):
        raise ValueError(f"model directory {model!r} does not exist")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    if not any(f.endswith(".safetensors") for f in os.listdir(model)):
        raise ValueError(f"model directory {model!r} has no *.safetensors weights")
    if not any(os.path.isfile(os.path.join(model, f)) for f in TOKENIZER_FILES):
        # transformers would silently build an empty tokenizer instead
        raise ValueError(f"model directory {model!r} has no tokenizer: expected one of "
                         f"{list(TOKENIZER_FILES)}")
    hf_config = read_config_json(model)
    archs = getattr(hf_config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"unsupported architecture {archs} in {model!r}; "
                         f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    return hf_config


def read_config_json(model: str) -> PretrainedConfig:
    """config.json through transformers' base PretrainedConfig (both formats: `dtype` or
    `torch_dtype`, `rope_parameters` or `rope_theta`), Qwen3Config's defaults filled in.

    Not AutoConfig: importing Qwen3Config imports transformers' modeling and generation stack
    for its docstring (7 s on the H200, where sklearn and accelerate are installed).
    """
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read config.json of {model!r}: {e}") from e
    missing = [name for name in REQUIRED_FIELDS if config_dict.get(name) is None]
    if missing:
        raise ValueError(f"config.json of {model!r} lacks {missing}")
    hf_config = PretrainedConfig.from_dict({**QWEN3_DEFAULTS, **config_dict})
    if getattr(hf_config, "num_key_value_heads", None) is None:  # as Qwen3Config: MHA
        hf_config.num_key_value_heads = hf_config.num_attention_heads
    return hf_config


def resolve_device(device: str) -> str:
    """'auto' means cuda when available, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible")
    return device


def check_tensor_parallel(tp_size: int, device: str, hf_config: PretrainedConfig) -> None:
    """Every rank needs its own GPU and an equal share of heads, MLP columns and vocabulary."""
    if device == "cuda" and tp_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp_size} exceeds the "
                         f"{torch.cuda.device_count()} visible CUDA GPU(s)")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "vocab_size"):
        value = getattr(hf_config, name)
        if value % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide {name}={value}; "
                             f"choose a divisor of {value}")


def resolve_dtype(dtype: str, device: str, hf_config: PretrainedConfig) -> torch.dtype:
    """'auto' means the checkpoint's dtype on GPU and float32 on CPU."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt, torch.bfloat16)
    return ckpt if ckpt in _DTYPES.values() else torch.bfloat16
