"""Engine configuration: one dataclass, validated once at construction."""
import os
from dataclasses import dataclass, field, fields

import torch
from transformers import PretrainedConfig

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE
from nanovllm.layers.backend_names import check_backend_name, resolve_attention_backend
from nanovllm.layers.quantization import QuantConfig, resolve_quant_config
from nanovllm.layers.rotary_embedding import rope_parameters
from nanovllm.models.registry import architecture, decoder_spec, with_family_defaults
from nanovllm.sampling_params import MAX_SEED, SamplingParams
from nanovllm.utils.field_checks import INT32_MAX, check, check_int, check_real, is_int
from nanovllm.utils.generation_config import sampling_defaults

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights from config.json alone (benchmarks)
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "vocab_size")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model dtype; fp8: float8_e4m3fn, per-layer scales
# Fields that only matter beside another: given without it they are refused, not ignored.
# name -> (what it needs, its default when not given)
FIELD_NEEDS = {"max_loras": ("enable_lora=True", 1), "max_lora_rank": ("enable_lora=True", 16),
               "max_cpu_loras": ("enable_lora=True", None),
               "calculate_kv_scales": ("kv_cache_dtype='fp8'", True)}


@dataclass
class Config:
    """Everything LLM(model, **kwargs) accepts; values discovered at run time live elsewhere."""

    model: str
    # a directory holding the tokenizer (vLLM's name); None: the model's own
    tokenizer: str | None = None
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    load_format: str = "auto"
    logprobs_mode: str = "raw"  # "raw": log_softmax(logits); "processed": what was sampled from
    kv_cache_dtype: str = "auto"
    # fp8: scales from the warm-up's K/V, else all 1.0 (None: FIELD_NEEDS' default, True)
    calculate_kv_scales: bool | None = None
    enable_lora: bool = False
    max_loras: int | None = None  # adapters in one batch: GPU slots in each projection (1)
    max_lora_rank: int | None = None  # 16
    max_cpu_loras: int | None = None  # adapters kept in host memory; None: max_loras
    # None: the checkpoint's weights as they are (FP8 when its quantization_config says so);
    # "fp8": a bf16/fp16/fp32 checkpoint quantized at load (per output channel, W8A8)
    quantization: str | None = None
    # "auto": generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty
    # are the defaults of generate() without SamplingParams and of server fields left unset
    # (vLLM's default); "vllm": SamplingParams' own; or a folder holding such a file
    generation_config: str = "auto"
    # the sampler's random draws (vLLM's default 0: a new engine repeats its samples); None:
    # torch's global RNG, which torch.manual_seed governs
    seed: int | None = 0
    # False: no request reuses another's cached K/V blocks (vLLM's name; on by default)
    enable_prefix_caching: bool = True
    sampling_defaults: dict = field(init=False, repr=False)
    hf_config: PretrainedConfig = field(init=False, repr=False)
    quant_config: QuantConfig | None = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    kv_cache_torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        self.model = os.path.expanduser(str(self.model))
        self._check_ranges()
        self.hf_config = load_hf_config(self.model, self.load_format)
        self.tokenizer = tokenizer_dir(self.tokenizer, self.model)
        self.sampling_defaults = sampling_defaults(self.model, self.generation_config)
        try:
            self.default_sampling_params()
        except ValueError as e:
            raise ValueError(f"generation_config.json's sampling defaults: {e}; pass "
                             f"generation_config='vllm' to leave them out") from None
        self.quant_config = resolve_quant_config(
            getattr(self.hf_config, "quantization_config", None), self.quantization)
        if self.enable_lora and self.quant_config is not None:
            raise ValueError(f"enable_lora=True with FP8 weights ({self.quant_config.method}) is "
                             "not supported: LoRA runs over bf16/fp16/fp32 weights")
        # Longer prompts than max_num_batched_tokens are prefilled in chunks over several steps.
        limit = self.hf_config.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            # refused, as vLLM refuses it: positions past the checkpoint's were never trained
            raise ValueError(f"max_model_len={self.max_model_len} exceeds this checkpoint's "
                             f"max_position_embeddings={limit}: choose at most {limit}")
        self.max_model_len = limit if self.max_model_len is None else self.max_model_len
        self.device = resolve_device(self.device)
        check_fp8_device(self.device, self.quant_config)
        check_tensor_parallel(self.tensor_parallel_size, self.device, self.hf_config)
        self.torch_dtype = resolve_dtype(self.dtype, self.device, self.hf_config)
        self.kv_cache_torch_dtype = FP8_DTYPE if self.kv_cache_dtype == "fp8" else self.torch_dtype
        # 'auto' resolved here, once: the ModelRunner builds the backend this names
        self.attention_backend = resolve_attention_backend(
            self.attention_backend, self.device, self.torch_dtype, self.kv_cache_dtype)

    def _check_ranges(self) -> None:
        # Counts and sizes become int32 tensor sizes and indices on the device.
        self.max_num_batched_tokens = check_int("max_num_batched_tokens",
                                                self.max_num_batched_tokens, 1)
        self.max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_model_len is not None:
            self.max_model_len = check_int("max_model_len", self.max_model_len, 2)
        self.gpu_memory_utilization = check_real(
            "gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0,
            "a number in (0, 1]", low_open=True)
        self.tensor_parallel_size = check_int("tensor_parallel_size", self.tensor_parallel_size,
                                              1, 8)
        block_size = self.kvcache_block_size
        check("kvcache_block_size", block_size, is_int(block_size) and 0 < block_size <= 2**20
              and block_size % 256 == 0, "a positive multiple of 256 up to 2**20")
        blocks = self.num_kvcache_blocks
        check("num_kvcache_blocks", blocks, is_int(blocks) and (blocks == -1 or 0 < blocks
                                                                 <= INT32_MAX),
              f"-1 (auto) or an int in [1, {INT32_MAX}]")
        for name, allowed in (("device", ("auto", "cpu", "cuda")), ("dtype", ("auto", *_DTYPES))):
            value = getattr(self, name)
            check(name, value, isinstance(value, str) and value in allowed,
                  f"one of {list(allowed)}")
        self._fill_needs()
        self.max_loras = check_int("max_loras", self.max_loras, 1, 256)
        self.max_lora_rank = check_int("max_lora_rank", self.max_lora_rank, 1, 512)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        self.max_cpu_loras = check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras,
                                       None, f"None or an int >= max_loras={self.max_loras}")
        for name in ("enforce_eager", "calculate_kv_scales", "enable_lora",
                     "enable_prefix_caching"):
            check(name, getattr(self, name), isinstance(getattr(self, name), bool), "a bool")
        check("kv_cache_dtype", self.kv_cache_dtype, isinstance(self.kv_cache_dtype, str)
              and self.kv_cache_dtype in KV_CACHE_DTYPES, f"one of {list(KV_CACHE_DTYPES)}")
        check("load_format", self.load_format, self.load_format in LOAD_FORMATS,
              f"one of {list(LOAD_FORMATS)}")
        check("logprobs_mode", self.logprobs_mode, self.logprobs_mode in ("raw", "processed"),
              "'raw' or 'processed'")
        check_backend_name(self.attention_backend)
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, 0, MAX_SEED,
                                  f"None or an int in [0, {MAX_SEED}]")

    def _fill_needs(self) -> None:
        """FIELD_NEEDS: a field given without what it needs is refused; one not given takes
        its default."""
        met = {"enable_lora=True": self.enable_lora is True,
               "kv_cache_dtype='fp8'": self.kv_cache_dtype == "fp8"}
        for name, (needs, default) in FIELD_NEEDS.items():
            value = getattr(self, name)
            if value is None:
                setattr(self, name, default)
            elif not met[needs]:
                raise ValueError(f"{name}={value!r} needs {needs}: without it, it would "
                                 f"change nothing")

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with generation_config's sampling fields (generate()'s None)."""
        return SamplingParams(**self.sampling_defaults)


def config_from_kwargs(model: str, kwargs: dict) -> Config:
    """Build a Config, naming any keyword it does not know."""
    names = {f.name for f in fields(Config) if f.init}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; LLM accepts "
                         f"{sorted(names - {'model'})}")
    return Config(model, **kwargs)


def load_hf_config(model: str, load_format: str = "auto") -> PretrainedConfig:
    """Check the model directory and read its config.json, with errors that name the problem."""
    if not os.path.isdir(model):
        raise ValueError(f"model directory {model!r} does not exist")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    if load_format == "auto" and not any(f.endswith(".safetensors") for f in os.listdir(model)):
        raise ValueError(f"model directory {model!r} has no *.safetensors weights")
    return read_config_json(model)


def tokenizer_dir(tokenizer: str | os.PathLike | None, model: str) -> str:
    """The directory the tokenizer loads from: tokenizer=, or the model's when None; checked
    to hold one of TOKENIZER_FILES, else a ValueError naming it."""
    if tokenizer is not None:
        check("tokenizer", tokenizer, isinstance(tokenizer, str | os.PathLike),
              "a directory path or None")
    path = model if tokenizer is None else os.path.expanduser(str(tokenizer))
    own = path == model  # load_hf_config has found the model directory
    where = "model directory" if own else "tokenizer directory"
    if not own and not os.path.isdir(path):
        raise ValueError(f"{where} {path!r} does not exist")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        # transformers would silently build an empty tokenizer instead
        hint = " (or pass tokenizer=DIR)" if own else ""
        raise ValueError(f"{where} {path!r} has no tokenizer: expected one of "
                         f"{list(TOKENIZER_FILES)}{hint}")
    return path


def read_config_json(model: str) -> PretrainedConfig:
    """config.json through the base PretrainedConfig, the family's defaults filled in, checked.
    Not AutoConfig: its family config classes import transformers' whole modeling stack."""
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read config.json of {model!r}: {e}") from e
    missing = [name for name in REQUIRED_FIELDS if config_dict.get(name) is None]
    if missing:
        raise ValueError(f"config.json of {model!r} lacks {missing}")
    config_dict = with_family_defaults(config_dict, architecture(config_dict, model))
    rope = rope_parameters(config_dict)
    # popped: the base class would try (and fail) to standardise them itself
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"):
        config_dict.pop(key, None)
    try:
        hf_config = PretrainedConfig.from_dict(config_dict)
    except Exception as e:  # transformers' own validators raise several types: name the file
        raise ValueError(f"invalid config.json of {model!r}: {e}") from e
    hf_config.rope_parameters = rope
    decoder_spec(hf_config)  # raises now, before anything is loaded, on what we lack
    return hf_config


def resolve_device(device: str) -> str:
    """'auto' means cuda when available, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible")
    return device


def check_fp8_device(device: str, quant_config: QuantConfig | None) -> None:
    """FP8 GEMMs need sm_89 or newer on CUDA (CPU runs the torch reference)."""
    if quant_config is None or device != "cuda":
        return
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise ValueError(f"FP8 weights ({quant_config.method}) need a GPU of compute capability "
                         f"8.9 or newer; this one is {capability[0]}.{capability[1]}")


def check_tensor_parallel(tp_size: int, device: str, hf_config: PretrainedConfig) -> None:
    """Every rank needs its own GPU and an equal share of heads, MLP columns and vocabulary."""
    if device == "cuda" and tp_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp_size} exceeds the "
                         f"{torch.cuda.device_count()} visible CUDA GPU(s)")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "moe_intermediate_size", "vocab_size"):
        value = getattr(hf_config, name, None)
        if value is None:  # moe_intermediate_size: mixture-of-experts models only
            continue
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
