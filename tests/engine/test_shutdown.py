"""An LLM after shutdown() refuses work with a RuntimeError that says so (it used to fail with
AttributeError: 'NoneType' object has no attribute 'num_kvcache_blocks'); DataParallelLLM is an
LLM that refuses what acts on one engine."""
import inspect

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.llm import DataParallelLLM

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

AFTER_SHUTDOWN = {
    "generate": lambda llm: llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False),
    "add_request": lambda llm: llm.add_request([1, 2, 3], PARAMS),
    "step": lambda llm: llm.step(),
    "chat": lambda llm: llm.chat([{"role": "user", "content": "hi"}], PARAMS, use_tqdm=False),
    "update_weights": lambda llm: llm.update_weights([("lm_head.weight", torch.zeros(1))]),
    "sleep": lambda llm: llm.sleep(),
}


@pytest.fixture(scope="module")
def shut_down(checkpoints):
    """An LLM that ran one request, then was shut down twice (the second call is harmless)."""
    llm = LLM(checkpoints["untied_gqa2_d16"], device="cpu", num_kvcache_blocks=8)
    (out,) = llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)
    assert len(out["token_ids"]) == 2
    llm.shutdown()
    llm.shutdown()
    return llm


@pytest.mark.parametrize("call", AFTER_SHUTDOWN.values(), ids=AFTER_SHUTDOWN.keys())
def test_a_shut_down_llm_refuses_work(shut_down, call):
    with pytest.raises(RuntimeError, match="shut down"):
        call(shut_down)


def test_shutdown_is_idempotent(shut_down):
    shut_down.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        shut_down.generate([[1, 2, 3]], PARAMS, use_tqdm=False)


# ---- DataParallelLLM, without Ray: the class and its refusals ------------------------------
REFUSED = ["add_request", "step", "abort_request", "new_tokens", "is_finished",
           "request_limits", "update_weights", "sleep", "wake_up", "add_lora", "remove_lora",
           "list_loras"]
SUPPORTED = ["generate", "chat", "stats", "reset_stats", "reset_prefix_cache", "shutdown",
             "get_default_sampling_params", "get_tokenizer"]


def test_data_parallel_llm_is_an_llm():
    """So `isinstance(LLM(path, data_parallel_size=2), LLM)` holds."""
    assert issubclass(DataParallelLLM, LLM)


def test_every_public_method_is_supported_or_refused():
    """A method of LLM that DataParallelLLM neither overrides nor refuses would run the plain
    engine's code on an object that has no scheduler or executor."""
    public = {name for name, _ in inspect.getmembers(LLM, callable) if not name.startswith("_")}
    assert public == set(REFUSED) | set(SUPPORTED)
    inherited = public - set(vars(DataParallelLLM))
    # LLM.chat goes through DataParallelLLM.generate; get_tokenizer returns the tokenizer
    # DataParallelLLM sets from its engine
    assert inherited == {"chat", "get_tokenizer"}


@pytest.mark.parametrize("name", REFUSED)
def test_data_parallel_llm_refuses_one_engine_methods(name):
    llm = object.__new__(DataParallelLLM)
    llm.data_parallel_size = 2
    with pytest.raises(NotImplementedError, match=rf"{name}\(\) is not supported with data "
                                                  r"parallelism \(data_parallel_size=2\)"):
        getattr(DataParallelLLM, name)(llm)
