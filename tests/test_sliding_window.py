"""The `sdpa` backend's sliding window and attention-logit soft-capping against a dense
reference (every position of each sequence, HF's rules written out: a query at position p
sees keys in (p - window, p]; scores s become cap * tanh(s / cap) before masking), over one
step that mixes decodes, a fresh prefill and prefill chunks with cached prefixes on shuffled
pages; and how the loader turns per-layer configs into backend requirements."""

from __future__ import annotations

import pytest
import torch

from fw.backends.attention.sdpa import SdpaBackend
from fw.errors import UnsupportedConfigurationError
from fw.layers import ModelContext
from fw.layers.attention import Attention, AttentionMetadata
from fw.model.attention_needs import check_built_layers, logit_softcap_needed, sliding_window_needed
from fw.plugins import AttentionBackendSpec

PAGE = 4
# (query_len, seq_len): four decodes, a fresh prompt, two chunks after cached prefixes
LAYOUT = [(1, 1), (1, 5), (1, 13), (1, 20), (11, 11), (6, 15), (3, 20)]


def reference(q, keys, values, q_pos, scale, window, cap):
    """q [n, H, D] at positions q_pos [n]; keys/values [L, Hkv, D] for positions 0..L-1."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    k_pos = torch.arange(keys.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)


def step(heads: int, kv_heads: int, dim: int, seed: int = 0):
    """Random K/V for every position of every sequence, written to shuffled pages (prefixes
    already cached), and this step's metadata, queries and new K/V."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 64
    cache = torch.zeros(SdpaBackend.kv_cache_shape(num_pages, PAGE, kv_heads, dim))
    pages = torch.randperm(num_pages, generator=gen).tolist()
    tables, seqs, slots, q_all, k_new, v_new, starts = [], [], [], [], [], [], [0]
    for q_len, seq_len in LAYOUT:
        used = -(-seq_len // PAGE)
        table = [pages.pop() for _ in range(used)]
        keys = torch.randn(seq_len, kv_heads, dim, generator=gen)
        values = torch.randn(seq_len, kv_heads, dim, generator=gen)
        for pos in range(seq_len - q_len):  # the cached prefix
            cache[0, :, table[pos // PAGE], pos % PAGE] = keys[pos]
            cache[1, :, table[pos // PAGE], pos % PAGE] = values[pos]
        new = range(seq_len - q_len, seq_len)
        slots += [table[pos // PAGE] * PAGE + pos % PAGE for pos in new]
        q_all.append(torch.randn(q_len, heads, dim, generator=gen) * 2)
        k_new.append(keys[seq_len - q_len:])
        v_new.append(values[seq_len - q_len:])
        tables.append(table)
        seqs.append((keys, values))
        starts.append(starts[-1] + q_len)
    block_tables = torch.zeros(len(LAYOUT), max(map(len, tables)), dtype=torch.long)
    for i, table in enumerate(tables):
        block_tables[i, :len(table)] = torch.tensor(table)
    meta = AttentionMetadata(
        num_decodes=sum(1 for q_len, _ in LAYOUT if q_len == 1),
        query_lens=[q_len for q_len, _ in LAYOUT], seq_lens=[s for _, s in LAYOUT],
        query_start_loc=torch.tensor(starts), seq_lens_tensor=torch.tensor([s for _, s in LAYOUT]),
        block_tables=block_tables, slot_mapping=torch.tensor(slots), page_size=PAGE,
    )
    return cache, meta, torch.cat(q_all), torch.cat(k_new), torch.cat(v_new), seqs


@pytest.mark.parametrize("cap", [None, 2.0], ids=["nocap", "cap2"])
@pytest.mark.parametrize("window", [None, 1, 4, 7, 64], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_sdpa_matches_dense_reference(heads, kv_heads, window, cap):
    dim, scale = 8, 8 ** -0.5
    cache, meta, q, k, v, seqs = step(heads, kv_heads, dim)
    backend = SdpaBackend(heads, kv_heads, dim, scale, sliding_window=window, logit_softcap=cap)
    meta.backend_state = SdpaBackend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta)
    start = 0
    for (q_len, seq_len), (keys, values) in zip(LAYOUT, seqs):
        q_pos = torch.arange(seq_len - q_len, seq_len)
        expected = reference(q[start:start + q_len], keys, values, q_pos, scale, window, cap)
        torch.testing.assert_close(out[start:start + q_len], expected, atol=1e-5, rtol=1e-5)
        start += q_len


def test_window_and_cap_change_the_result():
    """The cases above are not vacuous: the window and the cap each move the output."""
    cache, meta, q, k, v, _ = step(4, 2, 8)
    results = {}
    for window, cap in [(None, None), (4, None), (None, 2.0)]:
        meta.backend_state = SdpaBackend.prepare(meta)
        backend = SdpaBackend(4, 2, 8, 8 ** -0.5, sliding_window=window, logit_softcap=cap)
        results[window, cap] = backend.forward(q, k, v, cache.clone(), meta)
    plain = results[None, None]
    assert (results[4, None] - plain).abs().max() > 0.1
    assert (results[None, 2.0] - plain).abs().max() > 0.1


def test_plain_layers_build_no_window_state_and_short_sequences_share_the_plain_mask():
    cache, meta, q, k, v, _ = step(4, 2, 8)
    state = meta.backend_state = SdpaBackend.prepare(meta)
    SdpaBackend(4, 2, 8, 0.3).forward(q, k, v, cache, meta)
    assert state.decode_window_masks == {} and all(pf.window_masks == {} for pf in state.prefills)
    SdpaBackend(4, 2, 8, 0.3, sliding_window=64).forward(q, k, v, cache, meta)  # longer than every sequence
    assert state.decode_window_masks[64] is state.decode_mask
    assert all(pf.window_masks == {} for pf in state.prefills)
    SdpaBackend(4, 2, 8, 0.3, sliding_window=4).forward(q, k, v, cache, meta)  # built once, for all layers
    assert set(state.decode_window_masks) == {64, 4}
    assert all(set(pf.window_masks) == {4} for pf in state.prefills)


def test_prefill_does_not_read_pages_before_the_window():
    """A chunk at positions 17-19 with window 4 needs keys 14-19: pages 0-2 (positions 0-11) are
    never read, so poisoning them changes nothing."""
    cache, meta, q, k, v, seqs = step(4, 2, 8)
    meta.backend_state = SdpaBackend.prepare(meta)
    last = meta.block_tables[-1]
    cache[:, :, last[:3]] = float("nan")
    out = SdpaBackend(4, 2, 8, 0.3, sliding_window=4).forward(q, k, v, cache, meta)[-3:]
    keys, values = seqs[-1]
    torch.testing.assert_close(out, reference(q[-3:], keys, values, torch.arange(17, 20), 0.3, 4, None))


def test_sdpa_declares_both_capabilities():
    from fw.plugins.manager import get_plugin_manager

    spec = get_plugin_manager().registry("attention_backend").get("sdpa")
    assert spec.supports_sliding_window and spec.supports_logit_softcap


# -- requirements from per-layer configs ---------------------------------------------------------------


def _config(cls_name: str, **options):
    import transformers

    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                num_hidden_layers=4, vocab_size=64)
    return getattr(transformers, cls_name)(**{**base, **options})


@pytest.mark.parametrize("cls_name,options,window", [
    ("LlamaConfig", {}, None),
    ("MistralConfig", {"sliding_window": 8}, 8),
    ("MistralConfig", {"sliding_window": None}, None),
    ("Gemma2Config", {"sliding_window": 8}, 8),  # interleaved: layers 0 and 2 slide
    ("Gemma2Config", {"sliding_window": 8, "layer_types": ["full_attention"] * 4}, None),
    ("Gemma3TextConfig", {"sliding_window": 8, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, 8),
    ("Qwen2Config", {"use_sliding_window": False, "sliding_window": 8}, None),
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}, 8),  # layer 3 slides
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}, None),  # none does
    ("Qwen3Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, 8),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_window_is_required_when_some_layer_slides(cls_name, options, window):
    assert sliding_window_needed(_config(cls_name, **options)) == window


def test_softcap_requirement():
    assert logit_softcap_needed(_config("Gemma2Config", attn_logit_softcapping=5.0)) == 5.0
    assert logit_softcap_needed(_config("Gemma2Config", attn_logit_softcapping=None)) is None
    assert logit_softcap_needed(_config("LlamaConfig")) is None


def test_layers_needing_more_than_the_backend_supports_are_refused():
    """The safety net after building: a layer with a window on a backend without windows."""
    ctx = ModelContext(dtype=torch.float32, device=torch.device("cpu"), attention_backend=SdpaBackend)
    model = torch.nn.ModuleList([Attention(2, 1, 8, ctx), Attention(2, 1, 8, ctx, sliding_window=4)])
    plain = AttentionBackendSpec(name="plain", backend_cls=SdpaBackend)
    with pytest.raises(UnsupportedConfigurationError, match="sliding-window attention.*'plain'"):
        check_built_layers(model, plain)
    check_built_layers(model, AttentionBackendSpec(name="win", backend_cls=SdpaBackend, supports_sliding_window=True))
