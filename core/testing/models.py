"""Tiny random-weight Hugging Face checkpoints and an offline tokenizer, for plugin tests.

Everything is made locally from transformers' config classes: no network. The tokenizer is a
byte-level BPE trained on a few lines written here (512 tokens, `<pad>`/`<s>`/`</s>`). Weights
are drawn wider than transformers' init (which makes a model that repeats one token), so greedy
text varies and its top choice is not decided by rounding noise; the comparisons stay meaningful.

`tiny_checkpoint(architecture, path)` writes one; `architecture` is a Hugging Face class name
(`"LlamaForCausalLM"`) or a built-in fw architecture name (`"llama"`), or pass `hf_config`, whose
`vocab_size` must be at least `VOCAB_SIZE` (the tokenizer's ids index the embedding)."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast

VOCAB_SIZE = 512
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = ("the a of to in and is was for on with as by at from that this it be are or model token engine batch "
          "cache page block prefix sampler stream request output prompt logits attention layer weight tensor "
          "kernel memory device plugin backend river mountain forest ocean city garden window winter summer "
          "quick brown fox jumps over lazy dog one two three four five six seven eight nine ten yes no true "
          "false null name value key").split()
_LINES = ['{"name": "fw", "value": 42, "items": [1, 2, 3], "ok": true, "none": null}',
          "def add(a, b):\n    return a + b  # 0 1 2 3 4 5 6 7 8 9 -7 3.14 = 15%",
          "Once upon a time, in a small village by the river, there lived an old clockmaker.",
          "abc-123 xyz-456: yes; no! maybe? [x] {y} (z) <w> café naïve 你好 🙂"]

WINDOW = 8
# HF architecture -> (config class, config overrides); shapes as in fw's own tests
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "LlamaForCausalLM": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             num_hidden_layers=2, tie_word_embeddings=False)),
    "MistralForCausalLM": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                 num_hidden_layers=2, sliding_window=WINDOW)),
    "GemmaForCausalLM": ("GemmaConfig", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                             num_hidden_layers=2, tie_word_embeddings=True)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4, query_pre_attn_scalar=24,
        sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=10.0, tie_word_embeddings=True)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4, query_pre_attn_scalar=24,
        sliding_window=WINDOW, final_logit_softcapping=10.0, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                                             use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                             num_hidden_layers=2)),
    "MixtralForCausalLM": ("MixtralConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=48,
        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", dict(
        num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3, intermediate_size=96,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], qkv_bias=True, tie_word_embeddings=False)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2, intermediate_size=96,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        tie_word_embeddings=True)),
}
# fw's built-in architecture names -> the HF architecture their checkpoints name
FW_NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gemma": "GemmaForCausalLM",
            "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "transformers": "LlamaForCausalLM"}
_SANDWICH = ("gemma2", "gemma3", "gemma3_text")  # norms after attention and MLP: sharper weights needed


@functools.lru_cache(maxsize=1)
def tokenizer():
    """The offline byte-level BPE (built once per process, about 0.3 s), as a transformers fast tokenizer."""
    rng = random.Random(0)
    lines = _LINES * 5 + [" ".join(rng.choices(_WORDS, k=rng.randint(4, 12))) + rng.choice(".!?,;")
                          for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE)


def hf_architecture(name: str) -> str:
    """The HF class name for `name` (an HF class name or a built-in fw architecture name)."""
    name = FW_NAMES.get(name, name)
    if name not in ARCHITECTURES:
        raise KeyError(f"fw.testing has no tiny-model factory for {name!r}; known: "
                       f"{', '.join(sorted(ARCHITECTURES))} (or fw names {', '.join(sorted(FW_NAMES))}). "
                       f"Pass hf_config=<a transformers config> for another architecture.")
    return name


def make_config(architecture: str, **overrides: Any):
    """A small transformers config of `architecture`, sized to the kit's tokenizer."""
    architecture = hf_architecture(architecture)
    config_cls, shape = ARCHITECTURES[architecture]
    tok = tokenizer()
    options = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, max_position_embeddings=256,
                   rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id, architectures=[architecture])
    options.update(shape)
    options.update(overrides)
    return getattr(transformers, config_cls)(**options)


def model_class(config):
    """The transformers class for the config's first `architectures` entry (AutoModelForCausalLM otherwise)."""
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    return cls if cls is not None else transformers.AutoModelForCausalLM


def build_model(config):
    """A random-initialised transformers model for `config`: the class its first `architectures` entry
    names, else whatever AutoModelForCausalLM maps the config to (a third party's registered class)."""
    cls = model_class(config)
    return transformers.AutoModelForCausalLM.from_config(config) if cls is transformers.AutoModelForCausalLM \
        else cls(config)


def randomize(model, seed: int = 7) -> None:
    """Wide random weights in place (see the module docstring)."""
    sandwich = getattr(model.config, "model_type", "") in _SANDWICH
    gemma = getattr(model.config, "model_type", "").startswith("gemma")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = 0.1 if "embed" in name or "lm_head" in name else 0.3
                if sandwich and (".q_proj" in name or ".k_proj" in name):
                    std = 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:  # norm weights (and any other vector)
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
                if sandwich and any(n in name for n in ("post_", "q_norm", "k_norm")):
                    p.add_(2.0)
        norm = getattr(getattr(model, "model", None), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            norm.weight.fill_(3.0 if gemma else 4.0)


def check_vocab(config: Any, who: str = "fw.testing") -> None:
    """Raise ValueError unless `config.vocab_size` holds the kit tokenizer's VOCAB_SIZE ids."""
    size = getattr(config, "vocab_size", None)
    if not isinstance(size, int) or size < VOCAB_SIZE:
        raise ValueError(f"{who}: the config's vocab_size is {size!r}, but the kit's tokenizer has {VOCAB_SIZE} "
                         f"tokens, whose ids index the embedding; set vocab_size={VOCAB_SIZE} (or more)")


def tiny_checkpoint(architecture: str | None, path: str | Path, hf_config: Any = None, seed: int = 7) -> Path:
    """Write a random-weight checkpoint (config.json, model.safetensors, tokenizer) into `path`."""
    path = Path(path)
    config = hf_config if hf_config is not None else make_config(architecture)
    check_vocab(config, "tiny_checkpoint")
    torch.manual_seed(seed)
    model = build_model(config).to(torch.float32)
    randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer().save_pretrained(path)
    return path


def load_reference(path: str | Path):
    """transformers' own model on the checkpoint: fp32, eager attention (and experts), never stopping at EOS."""
    config = AutoConfig.from_pretrained(path)
    options: dict[str, Any] = dict(dtype=torch.float32, attn_implementation="eager")
    if any(k in config.to_dict() for k in ("num_experts", "num_local_experts")):
        options["experts_implementation"] = "eager"
    model = model_class(config).from_pretrained(path, **options)
    model.generation_config.eos_token_id = None
    return model.eval()


def greedy_reference(model, ids: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation of `ids` (never stopping at EOS) and each step's fp32 log-softmax."""
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=config, attention_mask=torch.ones(1, len(ids)))
    return out.sequences[0, len(ids):].tolist(), [torch.log_softmax(s[0].float(), dim=-1) for s in out.logits]
