"""Tiny random-weight Llama checkpoints and an offline tokenizer, for tests.

Everything is made locally: a byte-level BPE trained on text written here
(plus some CJK and emoji, so multi-byte characters have their own merges and
their raw bytes), wrapped in a transformers tokenizer with a chat template,
and Llama models built from `LlamaConfig` with fixed seeds. No network.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 512
BOS, EOS, PAD = "<s>", "</s>", "<pad>"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are or not have has "
    "model token engine batch cache page block prefix sampler stream request output prompt logits "
    "attention layer weight tensor kernel memory device plugin backend schedule decode prefill chunk "
    "river mountain forest ocean city garden window winter summer morning evening light shadow stone "
    "quick brown fox jumps over lazy dog bright little quiet green small large ancient modern simple "
    "run walk read write think speak listen build break carry follow open close begin finish hold "
    "one two three four five six seven eight nine ten hundred thousand first second last next every"
).split()

_PARAGRAPHS = [
    "Once upon a time, in a small village by the river, there lived an old clockmaker.",
    "The engine schedules every request in pages; each page holds sixteen tokens of keys and values.",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 +8 = 15%.",
    "汉字测试：你好，世界！今天天气很好。我们一起学习中文。",
    "日本語のテキストです。こんにちは、世界。",
    "Emoji time 🙂 😀 🚀 🎉 ❤️ 👍 — café naïve façade über straße.",
]


def corpus(num_sentences: int = 600, seed: int = 0) -> list[str]:
    """Deterministic training text: the paragraphs above plus random sentences of common words."""
    rng = random.Random(seed)
    lines = list(_PARAGRAPHS) * 5
    for _ in range(num_sentences):
        words = rng.choices(_WORDS, k=rng.randint(4, 14))
        sentence = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"])
        lines.append(sentence)
    return lines


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE with exactly `vocab_size` tokens, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"BPE reached {tok.get_vocab_size()} tokens, wanted {vocab_size}: add corpus text")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE,
    )


@dataclass(frozen=True)
class TinySpec:
    name: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    intermediate_size: int
    rope_theta: float
    tie_word_embeddings: bool
    seed: int


GQA = TinySpec("gqa", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
               intermediate_size=128, rope_theta=10000.0, tie_word_embeddings=True, seed=1)
MHA = TinySpec("mha", hidden_size=96, num_attention_heads=6, num_key_value_heads=6, num_hidden_layers=2,
               intermediate_size=160, rope_theta=500.0, tie_word_embeddings=False, seed=2)
SPECS = (GQA, MHA)


def build_model(spec: TinySpec, tokenizer, path: Path) -> Path:
    """Save a random-weight Llama of `spec` plus the tokenizer into `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=512,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    # HF's init (std 0.02) makes a model that repeats one token with a near-uniform distribution.
    # Wider weights give varied greedy text, and a larger final-norm scale a peaked distribution
    # (top-1 probability about 0.4), so greedy choices are not decided by rounding noise and
    # top-k / top-p / min-p have something to cut.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1 if "embed" in name or "lm_head" in name else 0.3)
        model.model.norm.weight.fill_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_hf(path: Path):
    """The reference: transformers' own Llama on the same checkpoint, fp32, eager attention."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    # generate() fills unset options from the model's generation config, so an eos_token_id=None
    # argument alone does not stop it ending at EOS; parity runs need the full length.
    model.generation_config.eos_token_id = None
    return model.eval()


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte of `text` (byte-level BPE's base alphabet), cutting every multi-byte character."""
    table = _bytes_to_unicode()
    ids = [tokenizer.convert_tokens_to_ids(table[b]) for b in text.encode("utf-8")]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise AssertionError(f"not every byte of {text!r} is a token")
    return ids


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE uses as its base alphabet."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
