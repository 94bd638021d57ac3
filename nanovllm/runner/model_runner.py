"""Runs the model for one rank: weights, the KV pool, step inputs, CUDA graphs."""
import logging
import threading
from functools import partial
from time import perf_counter

import torch

from nanovllm.config import Config
from nanovllm.kernels.compile_ahead import compile_threads, start_prewarm, start_workers
from nanovllm.layers.attention import Attention
from nanovllm.layers.backends import bind_backend, measures_fused_limits, select_backend
from nanovllm.layers.fused_calibration import (
    CALIBRATION_MAX_TOKENS,
    calibrate,
    cuda_graph_times,
)
from nanovllm.layers.linear import tp_rank_and_size
from nanovllm.layers.sampling.penalties import TokenCounts
from nanovllm.layers.sampling.sampler import Sampler, SamplerRNG
from nanovllm.lora.manager import LoRAManager
from nanovllm.models.registry import build_model
from nanovllm.runner.cuda_graphs import (
    capture_decode_graphs,
    graph_batch_sizes,
    graph_forwards,
    graph_inputs,
)
from nanovllm.runner.kv_cache import create_kv_cache, num_kv_blocks
from nanovllm.runner.prompt_logprobs import prompt_logprobs, wants_prompt_logprobs
from nanovllm.runner.sample_inputs import prepare_sample
from nanovllm.runner.sampled_ids import SampledIds, StepLogits
from nanovllm.runner.step_inputs import DecodeInputs, prepare_prefill
from nanovllm.runner.warmup import needs_kernel_warmup, warm_up_kernels, warm_up_peak
from nanovllm.sequence import Sequence
from nanovllm.utils.context import Context, forward_context
from nanovllm.utils.loader import load_dummy_weights, load_model
from nanovllm.utils.precision import check_float32_matmuls

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model shard and KV pool of one rank and executes scheduled batches."""

    def __init__(self, config: Config, rank: int = 0):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.block_size = config.kvcache_block_size
        self.device = torch.device(f"cuda:{rank}" if config.device == "cuda" else "cpu")
        if tp_rank_and_size() != (rank, self.world_size):
            # The layers shard themselves by the torch.distributed group they find.
            raise RuntimeError(f"rank {rank} of tensor_parallel_size={self.world_size} needs a "
                               f"process group of that size; found (rank, size) = "
                               f"{tp_rank_and_size()}")
        # > 0: each start-up phase compiles its kernels on threads first (kernels.compile_ahead),
        # through processes forked here, before this rank sets its device or starts a thread
        self.compile_threads = compile_threads(config.device, self.world_size)
        self.compile_workers = start_workers(self.compile_threads)
        if config.device == "cuda":
            torch.cuda.set_device(self.device)
        prewarm = start_prewarm(self.compile_threads, self.device)  # beside the weights' load
        hf_config = config.hf_config
        t0 = perf_counter()
        self.model = self.build_shard()
        # LoRA slots before the backend is bound (it binds their op) and before the warm-up
        # (they take memory the KV pool must not)
        self.lora_manager = LoRAManager(self.model, config) if config.enable_lora else None
        self.max_loras = config.max_loras if config.enable_lora else 0
        self.startup_s = {"load": perf_counter() - t0}
        self.fused_limits: dict[str, int] = {}  # calibrate_fused_limits's, on CUDA
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.backend = select_backend(config.attention_backend, config.device,
                                      config.kv_cache_dtype)
        bind_backend(self.model, self.backend)
        check_float32_matmuls(config.device, config.torch_dtype)
        self.use_cuda_graph = (config.device == "cuda" and not config.enforce_eager
                               and self.backend.cuda_graphs)
        self.sampler_rng = SamplerRNG()  # seeded once start-up's own steps are done
        self.sampler = Sampler(config.logprobs_mode, self.backend.fast_path.fused_sampler,
                               self.sampler_rng)
        self.vocab_size = hf_config.vocab_size  # read every step: a config attribute is slow
        self.token_counts = TokenCounts(self.vocab_size, self.device)  # penalties only
        self.temperatures: dict[tuple, torch.Tensor] = {}  # prepare_sample's uploaded rows
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_inputs: dict[int, tuple] = {}  # rows -> (buffer, its unpacked views)
        # Rank 0 of a tensor-parallel group: set once a worker dies, so a step stops waiting.
        self.peer_died: threading.Event | None = None
        self.max_num_blocks = -(-config.max_model_len // self.block_size)
        self.decode_inputs = DecodeInputs(config.max_num_seqs, self.max_num_blocks,
                                          self.block_size, pin=config.device == "cuda",
                                          max_loras=self.max_loras)
        if prewarm is not None:
            prewarm.join()
        try:
            self.start_up()
        finally:
            if self.compile_workers is not None:
                self.compile_workers.close()
                self.compile_workers = None

    def start_up(self) -> None:
        """Warm up (the activations' peak), size the KV pool, measure the fused limits, compile
        the kernels, capture the graphs; each phase's seconds go to startup_s."""
        config = self.config
        calibrate = config.kv_cache_dtype == "fp8" and config.calculate_kv_scales
        if config.device == "cuda" or calibrate:
            self._timed("warmup", warm_up_peak, self, calibrate)
        self.num_kvcache_blocks = self.allocate_kv_cache()
        if config.device == "cuda" and measures_fused_limits(self.backend.fast_path):
            self._timed("calibrate", self.calibrate_fused_limits)
        compiled = None  # graph inputs whose forwards the warm-up's compile pass ran
        if needs_kernel_warmup(config.device, self.backend.runs_triton):
            graph_sizes = graph_batch_sizes(config.max_num_seqs) if self.use_cuda_graph else []
            if graph_sizes and self.compile_threads:
                compiled = graph_inputs(config, self.max_num_blocks, self.device)
            forwards = graph_forwards(self.model, compiled) if compiled else []
            self._timed("kernels", warm_up_kernels, self, graph_sizes, forwards)
        if self.use_cuda_graph:
            self._timed("capture", self.capture_cudagraph, compiled)
        # after start-up's own steps: however many it ran, the first request draws the same
        self.sampler_rng.seed(config.seed, self.device)
        logger.info("start-up: %s (compile-ahead threads: %d)", ", ".join(
            f"{k} {v:.1f}s" for k, v in self.startup_s.items()), self.compile_threads)

    def _timed(self, phase: str, run, *args) -> None:
        t0 = perf_counter()
        run(*args)
        self.startup_s[phase] = perf_counter() - t0

    def build_shard(self) -> torch.nn.Module:
        """This rank's shard of the model, built in the model dtype on its device, loaded."""
        config = self.config
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with self.device:
                model = build_model(config.hf_config, config.quant_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            load_dummy_weights(model)
        else:
            load_model(model, config.model)
        return model

    # ---- memory -------------------------------------------------------------------------
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers: 2 (K and V) x layers x block x heads x dim."""
        layer = self.attn_layers[0]
        return (2 * len(self.attn_layers) * self.block_size * layer.num_kv_heads
                * layer.head_dim * self.config.kv_cache_torch_dtype.itemsize)

    @torch.inference_mode()
    def calibrate_fused_limits(self) -> None:
        """Bind each projection class the decode steps its fused kernel wins (measured)."""
        # the step sizes measured: the CUDA graphs' (1, 2, 3, 4, 6, ...), in eager mode too
        sizes = graph_batch_sizes(self.config.max_num_seqs)
        limits = calibrate(self.model, [n for n in sizes if n <= CALIBRATION_MAX_TOKENS],
                           partial(cuda_graph_times, compile_threads=self.compile_threads,
                                   workers=self.compile_workers))
        bind_backend(self.model, self.backend, limits)
        torch.cuda.empty_cache()  # the timing graphs' pools: the KV pool is sized already
        self.fused_limits = {f"{name} {list(shape)}": n for (name, shape), n in limits.items()}
        logger.info("fused decode projections up to (tokens, measured): %s",
                    ", ".join(f"{k}: {n}" for k, n in self.fused_limits.items()))

    def allocate_kv_cache(self) -> int:
        """Size the KV pool (kv_cache.num_kv_blocks), allocate it and return its block count."""
        config, block_bytes = self.config, self.block_bytes()
        num_blocks = num_kv_blocks(config, block_bytes, self.device, self.world_size)
        self.create_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens, %.1f MiB each, %s", num_blocks,
                    self.block_size, block_bytes / 2**20, config.kv_cache_torch_dtype)
        return num_blocks

    def create_kv_cache(self, num_blocks: int) -> None:
        """Allocate the pool of num_blocks blocks and wire it into the attention layers."""
        self.kv_cache = create_kv_cache(self.attn_layers, num_blocks, self.block_size,
                                        self.config.kv_cache_torch_dtype, self.device)

    def free_kv_cache_and_graphs(self) -> None:
        """Drop the CUDA graphs (their pool and buffers) and the KV pool."""
        self.graphs.clear()
        self.graph_inputs.clear()
        self.graph_outputs = None
        for attn in self.attn_layers:
            attn.k_cache = attn.v_cache = torch.tensor([])
        self.kv_cache = None

    # ---- step inputs --------------------------------------------------------------------
    def prepare_decode(self, seqs: list[Sequence], previous_ids: torch.Tensor | None = None,
                       source_rows: list[int] | None = None,
                       lora_slots: list[int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, Context]:
        """Decode inputs, written straight into the graph's input buffer when one will run."""
        # Sequence i with source_rows[i] = r >= 0 takes its input id from row r of previous_ids,
        # the in-flight step's sampled ids, on the device.
        graph_rows = min((b for b in self.graphs if b >= len(seqs)), default=None)
        rows, width = ((graph_rows, self.max_num_blocks) if graph_rows is not None
                       else (len(seqs), max(len(seq.block_table) for seq in seqs)))
        host = self.decode_inputs.pack(seqs, rows, width, source_rows, lora_slots)
        if graph_rows is not None:  # the graph's buffer, and the views it was captured with
            buf, (input_ids, positions, src, context) = self.graph_inputs[rows]
            buf.copy_(host, non_blocking=True)
        else:
            input_ids, positions, src, context = DecodeInputs.unpack(
                host.to(self.device, non_blocking=True), rows, width, self.max_loras)
            if lora_slots is None or max(lora_slots) < 0:
                context.lora_slots = None  # no row has an adapter: skip the LoRA ops
        if previous_ids is not None:
            n = len(seqs)
            if source_rows == list(range(n)):  # a batch that decoded together: one launch
                input_ids[:n].copy_(previous_ids[:n])
            else:
                carried = previous_ids[src.clamp(min=0)].int()
                input_ids.copy_(torch.where(src >= 0, carried, input_ids))
        return input_ids, positions, context

    # ---- execution ----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                context: Context) -> torch.Tensor:
        """Hidden states; decode batches replay the graph whose buffers hold the inputs (called
        inside launch's inference mode: entering it again costs every step)."""
        graph = None if context.is_prefill else self.graphs.get(input_ids.size(0))
        with forward_context(context):
            if graph is None:
                return self.model(input_ids, positions)
            graph.replay()
            return self.graph_outputs[:input_ids.size(0)]

    @torch.inference_mode()  # graph input buffers are inference tensors
    def launch(self, seqs: list[Sequence], is_prefill: bool,
               previous_ids: torch.Tensor | None = None, source_rows: list[int] | None = None,
               defer_sample: bool = False) -> SampledIds | StepLogits | None:
        """Enqueue one step without waiting for it; rank 0 returns its sampled ids, or with
        defer_sample its logits (if any row samples), for `sample` once the host knows the
        previous step's ids."""
        lora_slots = (self.lora_manager.activate([seq.lora_int_id for seq in seqs])
                      if self.lora_manager is not None else None)
        if is_prefill:
            input_ids, positions, context = prepare_prefill(seqs, self.block_size, self.device,
                                                            lora_slots)
        else:
            input_ids, positions, context = self.prepare_decode(seqs, previous_ids, source_rows,
                                                                lora_slots)
        hidden = self.forward(input_ids, positions, context)
        prompt = (prompt_logprobs(self.model, hidden, seqs)
                  if is_prefill and wants_prompt_logprobs(seqs) else [])
        if is_prefill:
            seqs = [seq for seq in seqs if seq.samples_next]  # the rows that get logits
        if not seqs:  # every chunk ends inside its prompt: nothing to sample
            if self.rank != 0:
                return None
            return SampledIds(torch.empty(0, dtype=torch.int64, device=self.device),
                              None, prompt, is_prefill)
        with forward_context(context):
            logits = self.model.compute_logits(hidden)
        if self.rank != 0:
            return None
        step = StepLogits(seqs, logits[:len(seqs)], prompt, is_prefill, list(map(len, seqs)))
        return step if defer_sample else self.sample(step)

    @torch.inference_mode()  # a deferred sample runs outside launch(): its tensors are too
    def sample(self, step: StepLogits) -> SampledIds:
        """Enqueue the sampler on a launched step's logits (rank 0)."""
        # Prepared after the (asynchronous) forward was launched, so it overlaps the GPU.
        out = self.sampler(step.logits, *prepare_sample(
            step.seqs, step.lengths, self.token_counts, self.vocab_size, self.device,
            self.temperatures, self.sampler_rng.cpu))
        return SampledIds(out.token_ids, out.logprobs, step.prompt_logprobs, step.is_prefill)

    def wait_idle(self) -> None:
        """Wait for all queued GPU work, ignoring the error that may have stopped it."""
        # Not after a tensor-parallel peer died: a collective waiting on it may never finish.
        if self.device.type == "cuda" and not (self.peer_died and self.peer_died.is_set()):
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:
                pass  # the caller is already handling the failure that raised this

    def run(self, seqs: list[Sequence], is_prefill: bool) -> SampledIds | None:
        """Execute one step and, on rank 0, wait for it and return its sampled ids."""
        # Waiting here makes a tensor-parallel step fail inside MultiprocExecutor.execute, which
        # names a dead worker.
        sampled = self.launch(seqs, is_prefill)
        if sampled is not None:
            sampled.wait(self.peer_died)
        return sampled

    def capture_cudagraph(self, compiled: dict[int, tuple] | None = None) -> None:
        """Capture the decode graphs (see cuda_graphs.capture_decode_graphs)."""
        self.graphs, self.graph_inputs, self.graph_outputs = capture_decode_graphs(
            self.model, self.config, self.max_num_blocks, self.device, self.compile_threads,
            self.compile_workers, compiled)

    def shutdown(self) -> None:
        """Free graphs, the KV pool and the weights."""
        self.free_kv_cache_and_graphs()
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

