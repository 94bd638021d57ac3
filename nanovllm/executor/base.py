"""One interface to run a step, and the rank commands, on one rank or many."""
from abc import ABC, abstractmethod

from nanovllm.config import Config
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.runner.rank_commands import RANK_COMMANDS
from nanovllm.runner.sampled_ids import SampledIds, StepLogits
from nanovllm.sequence import Sequence


class Executor(ABC):
    """Owns every rank of one engine; `runner` is rank 0's, in this process."""

    runner: ModelRunner
    # Whether a step may be launched before the previous one's ids reach the host: with one
    # rank; workers build their inputs from host token ids, so tensor parallelism runs lockstep.
    pipelined: bool

    @abstractmethod
    def execute(self, method: str, *args, **rank0_kwargs) -> object:
        """Run RANK_COMMANDS[method] on every rank; returns rank 0's result."""
        # rank0_kwargs go to rank 0 only: tensors, which reach other ranks through collectives.

    def launch(self, seqs: list[Sequence], is_prefill: bool, *carried,
               defer_sample: bool = False) -> SampledIds | StepLogits:
        """Start one step; returns rank 0's sampled ids, maybe still on their way."""
        # carried: (previous_ids, source_rows), and defer_sample (ModelRunner.launch): only when
        # pipelined, where the host may read a step's ids after the next one is launched
        assert not (carried or defer_sample) or self.pipelined
        return self.execute("run", seqs, is_prefill)

    def sample(self, step: StepLogits) -> SampledIds:
        """Sample a step launched with defer_sample (rank 0's work alone)."""
        return self.runner.sample(step)

    @abstractmethod
    def shutdown(self) -> None:
        """Free every rank's model, KV pool and graphs (and end the other ranks); idempotent."""


class UniprocExecutor(Executor):
    """One rank, in this process: commands are plain calls."""

    pipelined = True

    def __init__(self, config: Config):
        self.runner = ModelRunner(config, 0)

    def execute(self, method: str, *args, **rank0_kwargs) -> object:
        return RANK_COMMANDS[method](self.runner, *args, **rank0_kwargs)

    def launch(self, seqs: list[Sequence], is_prefill: bool, *carried,
               defer_sample: bool = False) -> SampledIds | StepLogits:
        return self.runner.launch(seqs, is_prefill, *carried, defer_sample=defer_sample)

    def shutdown(self) -> None:
        self.runner.shutdown()

