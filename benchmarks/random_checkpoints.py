"""Random checkpoints of each supported family and a small BPE tokenizer, for demos, benchmarks
and tests.

No machine here can download weights, so tests, example.py and bench.py build their own.
"""
import json
import os
import random

QWEN3_0_6B_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        vocab_size=151936, tie_word_embeddings=True,
                        max_position_embeddings=40960)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                  tie_word_embeddings=False, max_position_embeddings=4096)
EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_WORDS = ("the a engine block cache token model paged attention kernel graph decode prefill "
          "sequence batch scheduler tensor parallel sample greedy hello world river stone "
          "light quick brown fox jumps over lazy dog number one two three four").split()


def corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English lines to train the tokenizer on."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))
            for _ in range(num_lines)]


def build_tokenizer(path: str, vocab_size: int = 400):
    """Train a byte-level BPE on `corpus()` and save it (with a chat template) to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_wide_tokenizer(path: str, vocab_size: int, seed: int = 0):
    """Save a byte-level tokenizer of `vocab_size` synthetic tokens (words with and without a
    leading space, digits, punctuation and JSON fragments, whitespace runs) to `path`.

    Grammar masks cost per token of the vocabulary, so measuring them needs one as wide as a
    real model's (151,643 for Qwen3); the small trained tokenizer has 400.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    special = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
    vocab = dict.fromkeys(special + sorted(pre_tokenizers.ByteLevel.alphabet()))
    pieces = ['":', '",', '{"', '"}', '["', '"]', ',"', '":"', "Ġ{", "Ġ[", "Ċ", "ĠĠ", "ĉ"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < vocab_size:
        kind = rng.random()
        if kind < 0.8:  # a word, a third of them capitalised, most after a space
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            word = word.capitalize() if rng.random() < 0.3 else word
            vocab["Ġ" + word if rng.random() < 0.6 else word] = None
        elif kind < 0.9:
            vocab[str(rng.randint(0, 99999))] = None
        else:
            vocab["".join(rng.choice(pieces) for _ in range(rng.randint(1, 3)))] = None
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_checkpoint(path: str, seed: int = 0, initializer_range: float = 0.5,
                     dtype: str = "float32", family: str = "Qwen3", **fields) -> str:
    """Save a random <family>ForCausalLM (Qwen3, Qwen3Moe, Qwen2, Llama, Mistral) plus
    tokenizer to `path`; returns `path`.

    A large initializer_range keeps greedy decoding from repeating one token, so parity
    tests compare varied sequences. `fields` override TINY_SHAPE's and set any other field of
    the family's config class (rope_parameters, sliding_window, attention_bias, ...).
    """
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer(path, vocab_size=min(400, fields.get("vocab_size", 512)))
    config = getattr(transformers, f"{family}Config")(
        **{**TINY_SHAPE, **fields}, initializer_range=initializer_range, rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    with torch.device("cpu"):
        model = getattr(transformers, f"{family}ForCausalLM")(config).to(torch_dtype)
    model.save_pretrained(path)  # safetensors; config.json records the dtype
    with open(os.path.join(path, "nanovllm_random_checkpoint.json"), "w") as f:
        json.dump({"note": "random weights, for tests and demos only", "seed": seed}, f)
    return path


def qwen3_0_6b_random() -> str:
    """A random bf16 checkpoint of Qwen3-0.6B's exact shape, built once in the temp directory."""
    import tempfile
    path = os.path.join(tempfile.gettempdir(), "nanovllm-qwen3-0.6b-random")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        build_checkpoint(path, initializer_range=0.02, dtype="bfloat16", **QWEN3_0_6B_SHAPE)
    return path
