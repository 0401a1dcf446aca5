"""Test helpers for the ParallelLM plugin: a plain PyTorch reference implementation (dense
attention over the whole sequence, no fw code), an offline tokenizer, and a random-weight
checkpoint directory written from the reference's weights. No network.

transformers has no ParallelLM, so this reference is the numerical oracle: fw must produce the
same greedy tokens and logprobs within 1e-3 on the same fp32 weights."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PLUGIN_ROOT = Path(__file__).resolve().parent.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

try:  # the installed package, else the checkout (the tests run without installing the plugin)
    import fw_example_arch  # noqa: F401
except ImportError:
    sys.path.insert(0, str(PLUGIN_ROOT))

from fw_example_arch.config import ARCHITECTURE, ParallelLMConfig  # noqa: E402

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "parallel blocks add attention and the mlp to one residual stream",
    "a research architecture arrives as its own plugin package",
    "one two three four five six seven eight nine ten",
] * 4


def build_tokenizer():
    """A byte-level BPE of 300 tokens with BOS, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tiny_config(tokenizer, **overrides) -> ParallelLMConfig:
    """GQA (4 query heads over 2 KV heads), two layers, untied head."""
    values = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=500.0, max_position_embeddings=256,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  architectures=[ARCHITECTURE])
    return ParallelLMConfig(**{**values, **overrides})


# -- the reference ---------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RefAttention(nn.Module):
    def __init__(self, cfg: ParallelLMConfig):
        super().__init__()
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.h, self.kv, self.d, self.eps = h, kv, d, cfg.norm_eps
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = nn.Module()
        self.q_norm.weight = nn.Parameter(torch.ones(d))
        self.k_norm = nn.Module()
        self.k_norm.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = rms_norm(self.q_proj(x).view(n, self.h, self.d), self.q_norm.weight, self.eps)
        k = rms_norm(self.k_proj(x).view(n, self.kv, self.d), self.k_norm.weight, self.eps)
        v = self.v_proj(x).view(n, self.kv, self.d)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        group = self.h // self.kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.d**-0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.o_proj(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1))


class RefMLP(nn.Module):
    def __init__(self, cfg: ParallelLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RefBlock(nn.Module):
    def __init__(self, cfg: ParallelLMConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=False)
        self.self_attn = RefAttention(cfg)
        self.mlp = RefMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.self_attn(h, cos, sin) + self.mlp(h)


class ReferenceParallelLM(nn.Module):
    """ParallelLM as plain PyTorch; parameter names are the checkpoint's tensor names."""

    def __init__(self, cfg: ParallelLMConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(RefBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.model.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=False)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] of the whole sequence."""
        d = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        freqs = torch.outer(torch.arange(len(ids), dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(torch.tensor(ids))
        for block in self.model.layers:
            x = block(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def greedy(self, ids: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy continuation and each step's log-softmax, recomputing the whole sequence each step."""
        ids, tokens, logprobs = list(ids), [], []
        for _ in range(new_tokens):
            lp = torch.log_softmax(self(ids)[-1].float(), dim=-1)
            tokens.append(int(lp.argmax()))
            logprobs.append(lp)
            ids.append(tokens[-1])
        return tokens, logprobs


def random_reference(cfg: ParallelLMConfig, seed: int = 0) -> ReferenceParallelLM:
    """Random weights wide enough for varied greedy text; norm weights away from 1 so they matter."""
    torch.manual_seed(seed)
    ref = ReferenceParallelLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1 if "embed" in name or "lm_head" in name else 0.3)
            else:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        ref.model.norm.weight.mul_(4.0)  # a peaked final distribution: no greedy choice is a near-tie
    return ref


def write_checkpoint(path: Path, ref: ReferenceParallelLM, tokenizer) -> Path:
    """config.json (the plugin's config class), model.safetensors and the tokenizer."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    ref.cfg.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path / "model.safetensors"))
    tokenizer.save_pretrained(path)
    return path
