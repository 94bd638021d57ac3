"""update_weights, sleep and wake_up on CPU: transformers' tokens for the new weights, identical
outputs across sleep, and the errors a user can cause."""
import random

import pytest
import torch

from benchmarks.random_checkpoints import build_checkpoint
from nanovllm import LLM, SamplingParams
from tests.reference import hf_greedy, load_hf

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    """The tiny shape with different weights (and the same tokenizer)."""
    return build_checkpoint(str(tmp_path_factory.mktemp("other")), seed=7)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    # 300 tokens: more than a 256-token block, so a repeat hits the prefix cache
    return [[rng.randrange(3, 400) for _ in range(n)] for n in (300, 9)]


@pytest.fixture()
def llm(tiny_model):
    engine = LLM(tiny_model, num_kvcache_blocks=16)
    yield engine
    engine.shutdown()


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out["token_ids"] for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_update_weights_gives_the_new_models_tokens_and_drops_the_prefix_cache(
        llm, other_model, prompts):
    greedy_tokens(llm, prompts)  # fills the prefix cache with the old weights' K/V
    hf = load_hf(other_model)
    llm.update_weights(hf.state_dict().items())
    assert greedy_tokens(llm, prompts) == [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    assert llm.stats()["cache_hit_blocks"] == 0


def layouts(llm: LLM) -> dict:
    return {n: (p.shape, p.stride()) for n, p in llm.model_runner.model.named_parameters()}


def test_sleep_and_wake_up_keep_the_outputs(llm, tiny_model, prompts):
    """Outputs and weight layouts (row-parallel weights are k-major) survive sleep levels 1, 2."""
    before, layout = greedy_tokens(llm, prompts), layouts(llm)
    # down_proj's weight is [64, 128] (out, in), stored [128, 64]
    assert layout["model.layers.0.mlp.down_proj.weight"][1] == (1, 64)
    llm.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep(2)
    llm.wake_up()
    assert greedy_tokens(llm, prompts) == before and layouts(llm) == layout
    llm.sleep(2)
    assert all(p.numel() == 0 for p in llm.model_runner.model.parameters())
    llm.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.update_weights(load_hf(tiny_model).state_dict().items())  # vLLM's order
    assert greedy_tokens(llm, prompts) == before and layouts(llm) == layout


def test_errors_name_the_problem_and_change_nothing(llm, prompts):
    before = greedy_tokens(llm, prompts)
    with pytest.raises(ValueError, match="level=3"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="'model.nope.weight' has no matching parameter"):
        llm.update_weights([("model.nope.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="pairs"):
        llm.update_weights([torch.zeros(2)])
    llm.add_request(prompts[1], GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        llm.update_weights([])
    with pytest.raises(RuntimeError, match="idle"):
        llm.sleep()
    while not llm.is_finished():
        llm.step()
    assert greedy_tokens(llm, prompts) == before


def _wrong_shapes(state: dict) -> list[tuple[str, torch.Tensor]]:
    """Tensors of the right names and the wrong shapes: a copy_ or a narrow took each."""
    k, down = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"
    return [(k, torch.cat([state[k], state[k]])),  # more rows: the first ones were taken
            (down, state[down].t().contiguous()),  # transposed: reshaped into place
            ("model.norm.weight", state["model.norm.weight"][:1]),  # [1]: broadcast
            ("model.embed_tokens.weight", torch.cat([state["model.embed_tokens.weight"]] * 2)),
            ("lm_head.weight", state["lm_head.weight"][:, :1])]


def test_a_wrong_shape_is_a_value_error_and_the_prefix_cache_is_dropped(
        llm, other_model, prompts):
    """Each wrong-shaped tensor is a ValueError naming it. The pairs before it are loaded,
    so the prefix cache is dropped anyway: the next outputs are the new weights' own."""
    greedy_tokens(llm, prompts)  # fills the prefix cache
    hf = load_hf(other_model)
    state = hf.state_dict()
    for name, tensor in _wrong_shapes(state):
        with pytest.raises(ValueError, match=f"{name}.*shape"):
            llm.update_weights([*state.items(), (name, tensor)])
    assert greedy_tokens(llm, prompts) == [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]


def test_after_sleep_2_every_weight_must_come_back(llm, tiny_model, prompts):
    """After sleep(level=2) the engine runs only once update_weights has refilled every
    parameter: a later sleep(1), an empty or a partial update keep it refused."""
    before = greedy_tokens(llm, prompts)
    state = list(load_hf(tiny_model).state_dict().items())
    llm.sleep(2)
    llm.wake_up()
    llm.sleep(1)
    llm.wake_up()
    for part in ([], state[:len(state) // 2]):
        llm.update_weights(part)
        with pytest.raises(RuntimeError, match="update_weights"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.update_weights(state[len(state) // 2:])  # with the first half: all of them
    assert greedy_tokens(llm, prompts) == before


def test_tensor_parallel_update_weights_and_sleep(tiny_model, other_model, prompts):
    """TP=2 (gloo): every rank loads its shard of the broadcast tensors, and sleeps."""
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    try:
        hf = load_hf(other_model)
        llm.update_weights(hf.state_dict().items())
        expected = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
        assert greedy_tokens(llm, prompts) == expected
        llm.sleep(2)
        llm.wake_up()
        llm.update_weights(hf.state_dict().items())
        assert greedy_tokens(llm, prompts) == expected
    finally:
        llm.shutdown()
