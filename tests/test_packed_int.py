"""fw's packed CPU kernels (fw.kernels.packed_int): 4-bit (w = d q + m) and 8-bit (w = d q) blocks of 32,
activations quantized to int8 per block inside the kernel; fp8 e4m3 (w = s code) widened to bf16 in registers.

Two references: `reference_linear` (the activations quantized the kernel's way, then a float64 product with
the dequantized weight), which the kernels must meet within fp32 rounding; and the plain dequantize-then-
matmul x @ W^T, which they meet within the activations' int8 rounding. Shapes are ragged: M rows around
the kernel's 8-row passes, N around its 16-row tiles, K a multiple of the 32-input block but not of 64."""

from __future__ import annotations

import pytest
import torch

from fw.kernels import packed_int

pytestmark = pytest.mark.skipif(not packed_int.ready(), reason="no AVX512-VNNI CPU or no C++ toolchain")

SHAPES = [(1, 16, 32), (2, 17, 64), (7, 100, 96), (8, 576, 576), (9, 33, 1536), (64, 960, 160), (300, 50, 128)]


def _blocks(bits: int, n: int, k: int, gen: torch.Generator) -> packed_int.QuantBlocks:
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        return packed_int.QuantBlocks(4, codes, scale, (torch.randn(n, k // 32, generator=gen) * 0.1).half().float())
    return packed_int.QuantBlocks(8, torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_kernel_matches_references(m, n, k, bits, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + bits)
    blocks = _blocks(bits, n, k, gen)
    weight = packed_int.pack(blocks)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4).to(dtype)
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    out = packed_int.packed_linear(x, [weight])
    assert out.dtype == dtype and out.shape == (m, n)
    got = packed_int.packed_linear(x, [weight], fp32_out=True).double()
    emulated = packed_int.reference_linear(x, blocks)
    assert (got - emulated).abs().max() <= 1e-5 * emulated.abs().max()
    exact = x.double() @ blocks.dequantize().double().T
    assert (got - exact).norm() <= 2e-2 * exact.norm()  # int8 activations: ~0.5% here
    torch.testing.assert_close(out.float(), got.float().to(dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("bits, m", [(4, 1), (4, 5), (4, 8), (4, 9), (4, 64), (4, 300), (8, 1), (8, 4), (8, 9),
                                     (8, 300)])
def test_heavy_blocks_take_the_residual_at_every_size(m, bits):
    """A row whose outlier channels make a few blocks' scales large takes the second term in those blocks only,
    at decode sizes (8-bit weights: up to 4 rows without a branch) and above: the kernel matches the reference
    that models it, and its error against the exact product falls well below one term's."""
    gen = torch.Generator().manual_seed(m)
    n, k = 96, 576
    blocks = _blocks(bits, n, k, gen)
    weight = packed_int.pack(blocks)
    x = torch.randn(m, k, generator=gen)
    outliers = [7, 100, 101, 450]  # channels in blocks 0, 3 and 14 of 18
    x[:, outliers] = 40 * torch.randn(m, 4, generator=gen).sign()
    squared = (x.view(m, -1, 32).abs().amax(-1) / 127).double() ** 2
    heavy = squared * (k // 32) >= packed_int.HEAVY_FACTOR * squared.sum(1, keepdim=True)
    assert heavy[:, [0, 3, 14]].all() and heavy.sum(1).max() <= (k // 32) // packed_int.HEAVY_FACTOR
    got = packed_int.packed_linear(x, [weight], fp32_out=True).double()
    emulated = packed_int.reference_linear(x, blocks)
    assert (got - emulated).abs().max() <= 1e-5 * emulated.abs().max()
    dense = blocks.dequantize().double()
    exact = x.double() @ dense.T
    one_term = packed_int.quantize_activations(x, residual=False).double() @ dense.T  # the same int8 rounding, one term
    assert (got - exact).norm() < 0.2 * (one_term - exact).norm()


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_the_same_alone_and_among_others(bits):
    """Products choose a row's second-term blocks by the row alone: its result is bit for bit the same in a step
    of 1 to 9 or 40 rows, so a greedy request answers the same alone, batched, or after a cached prefix, and an LM
    head in a padded compiled step gives the eager step's logits. Up to 8 rows (4-bit) or 4 (8-bit) the kernel
    runs without a branch, above with one; every row, not only the first, is checked at every size."""
    gen = torch.Generator().manual_seed(5)
    weight = packed_int.pack(_blocks(bits, 64, 576, gen))
    x = torch.randn(40, 576, generator=gen)
    x[:, [3, 200]] = 30.0
    x[1::3, 400] = -25.0  # rows whose heavy blocks differ from their neighbours'
    alone = torch.cat([packed_int.packed_linear(x[r:r + 1], [weight], fp32_out=True) for r in range(40)])
    for rows in (*range(2, 10), 40):
        assert torch.equal(packed_int.packed_linear(x[:rows], [weight], fp32_out=True), alone[:rows]), rows


def test_a_row_parallel_slice_chooses_heavy_blocks_against_the_whole_row():
    """A tensor-parallel rank of a row-parallel layer holds half of each row's blocks. Given the whole row's
    sum of squared scales (fw.layers.parallel.WholeRows: the ranks' sums added, here by hand) it takes the
    residual term in the blocks one process would, so the two halves add up to the one-process reference;
    against its half's own mean it chooses others (block 14, a moderate outlier, counts as heavy in its half)."""
    from fw.layers.parallel import WholeRows

    gen = torch.Generator().manual_seed(5)
    m, n, k = 64, 96, 576
    blocks = _blocks(4, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    x[:, [7, 100]] = 40 * torch.randn(m, 2, generator=gen).sign()  # blocks 0 and 3: the left half
    x[:, 450] = 12 * torch.randn(m, generator=gen).sign()  # block 14: heavy against the right half's mean only
    half, kb = k // 2, k // 64
    parts = [(x[:, :half].contiguous(), packed_int.QuantBlocks(4, blocks.codes[:, :half].contiguous(),
                                                               blocks.scale[:, :kb].contiguous(),
                                                               blocks.offset[:, :kb].contiguous())),
             (x[:, half:].contiguous(), packed_int.QuantBlocks(4, blocks.codes[:, half:].contiguous(),
                                                               blocks.scale[:, kb:].contiguous(),
                                                               blocks.offset[:, kb:].contiguous()))]
    squares = [packed_int.row_scale_squares(xs) for xs, _ in parts]
    whole = WholeRows(k, lambda own: squares[0] + squares[1])
    emulated = packed_int.reference_linear(x, blocks)  # one process: the whole row's mean

    def split(whole_rows) -> torch.Tensor:
        return sum(packed_int.packed_linear(xs, [packed_int.pack(b)], fp32_out=True, whole_rows=whole_rows).double()
                   for xs, b in parts)

    assert (split(whole) - emulated).abs().max() <= 1e-5 * emulated.abs().max()
    assert (split(None) - emulated).abs().max() > 1e-4 * emulated.abs().max()


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_of_a_packed_weight_are_its_dequantized_rows(bits):
    """PackedRowEmbedding (a tied GGUF embedding read from the head's packed blocks) gives exactly the
    dequantized rows, in any order and at tile edges of a row count that is no multiple of 16."""
    from fw.layers.packed_embedding import PackedRowEmbedding, gather_rows

    gen = torch.Generator().manual_seed(3)
    blocks = _blocks(bits, 37, 96, gen)
    embedding = PackedRowEmbedding(packed_int.pack(blocks), torch.bfloat16)
    ids = torch.tensor([[36, 0, 15], [16, 31, 32]])
    want = blocks.dequantize().float().bfloat16()[ids]
    got = embedding(ids)
    assert got.shape == (2, 3, 96) and got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert embedding(torch.tensor([], dtype=torch.long)).shape == (0, 96)
    # fp32 and fp16 round the same fp32 value once; int32 ids read the same rows
    flat = ids.reshape(-1)
    for dtype in (torch.float32, torch.float16):
        got = gather_rows(embedding.packed, flat.int(), dtype)
        assert got.dtype == dtype and torch.equal(got, blocks.dequantize().float().to(dtype)[flat])


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_of_a_packed_weight_reject_a_row_outside_it(bits):
    from fw.layers.packed_embedding import gather_rows

    packed = packed_int.pack(_blocks(bits, 37, 96, torch.Generator().manual_seed(4)))  # 3 tiles: 48 padded rows
    with pytest.raises(RuntimeError, match="row 48 is outside"):
        gather_rows(packed, torch.tensor([0, 48]), torch.bfloat16)
    with pytest.raises(RuntimeError, match="row 37 is outside the weight's 37 rows"):  # a padding row of the tile
        gather_rows(packed, torch.tensor([37]), torch.bfloat16)
    with pytest.raises(RuntimeError, match="row -1 is outside"):
        gather_rows(packed, torch.tensor([-1]), torch.bfloat16)


needs_f8 = pytest.mark.skipif(not packed_int.applies("cpu", 32, widening=True), reason="no AVX512-BF16/VBMI CPU")


def _fp8_blocks(n: int, k: int, gen: torch.Generator) -> packed_int.Fp8Blocks:
    """Every e4m3 value appears (subnormals, +-448, zeros of both signs), NaN codes left out."""
    raw = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x80  # NaN -> -0
    raw.view(-1)[: min(256, raw.numel())] = torch.arange(256, dtype=torch.uint8)[: min(256, raw.numel())] % 0x7F
    scale = torch.rand(n, k // 32, generator=gen) * 1e-3 + 1e-5
    return packed_int.Fp8Blocks(raw.view(torch.float8_e4m3fn), scale)


@needs_f8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_f8_kernel_matches_references(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    blocks = _fp8_blocks(n, k, gen)
    weight = packed_int.pack(blocks)
    x = (torch.randn(m, k, generator=gen) * 4).to(dtype)
    got = packed_int.packed_linear(x, [weight], fp32_out=True).double()
    emulated = packed_int.reference_linear(x, blocks)  # bf16 activations, exact weights
    assert (got - emulated).abs().max() <= 1e-5 * emulated.abs().max()
    if dtype == torch.bfloat16:  # the plain dequantize-then-matmul: the same numbers, fp32 sums
        exact = x.double() @ blocks.dequantize().double().T
        assert (got - exact).abs().max() <= 1e-5 * exact.abs().max()
    out = packed_int.packed_linear(x, [weight])
    torch.testing.assert_close(out.float(), got.float().to(dtype).float(), rtol=0, atol=0)


@needs_f8
def test_f8_subnormal_codes_count():
    """e4m3 subnormals (codes 0x01..0x07, values 2^-9 .. 7 * 2^-9) become normal bf16: vdpbf16ps flushes bf16
    subnormals, which a bit-shift widening would have produced."""
    codes = torch.zeros(16, 32, dtype=torch.uint8)
    codes[torch.arange(7), torch.arange(7)] = torch.arange(1, 8, dtype=torch.uint8)
    codes[7, 7] = 0x81  # -2^-9
    weight = packed_int.pack(packed_int.Fp8Blocks(codes.view(torch.float8_e4m3fn), torch.ones(16, 1)))
    got = packed_int.packed_linear(torch.ones(1, 32), [weight], fp32_out=True)[0, :8]
    want = torch.tensor([1, 2, 3, 4, 5, 6, 7, -1]) * 2.0 ** -9
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _wide_int8_blocks(n: int, k: int, gen: torch.Generator) -> packed_int.WideInt8Blocks:
    """Every int8 code -127..127 appears, each block with its own fp32 scale."""
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    every = min(255, codes.numel())
    codes.view(-1)[:every] = torch.arange(-127, 128, dtype=torch.int8)[:every]
    return packed_int.WideInt8Blocks(codes, torch.rand(n, k // 32, generator=gen) * 1e-3 + 1e-5)


@needs_f8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_wide_int8_kernel_matches_references(m, n, k, dtype):
    """int8 codes widened to bf16 (W8A16): the activations as given (bf16), products exact, fp32 sums."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k + 7)
    blocks = _wide_int8_blocks(n, k, gen)
    weight = packed_int.pack(blocks)
    x = (torch.randn(m, k, generator=gen) * 4).to(dtype)
    got = packed_int.packed_linear(x, [weight], fp32_out=True).double()
    emulated = packed_int.reference_linear(x, blocks)
    assert (got - emulated).abs().max() <= 1e-5 * emulated.abs().max()
    if dtype == torch.bfloat16:  # the plain dequantize-then-matmul: no activation rounding at all
        exact = x.double() @ blocks.dequantize().double().T
        assert (got - exact).abs().max() <= 1e-5 * exact.abs().max()
    out = packed_int.packed_linear(x, [weight])
    torch.testing.assert_close(out.float(), got.float().to(dtype).float(), rtol=0, atol=0)


@needs_f8
@pytest.mark.parametrize("kind", ["f8", "i8"])
def test_widening_kernels_answer_a_row_the_same_at_any_batch_size(kind):
    """Above 8 rows the widening kernels take up to 64 rows a pass (each record widened once for all of them):
    every row's sums are the ones it gets alone, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    blocks = _fp8_blocks(50, 192, gen) if kind == "f8" else _wide_int8_blocks(50, 192, gen)
    weight = packed_int.pack(blocks)
    x = (torch.randn(150, 192, generator=gen) * 4).bfloat16()
    together = packed_int.packed_linear(x, [weight], fp32_out=True)
    for r in (0, 7, 8, 63, 64, 65, 149):
        alone = packed_int.packed_linear(x[r:r + 1], [weight], fp32_out=True)
        assert torch.equal(together[r:r + 1], alone), r


@needs_f8
def test_wide_int8_refuses_a_code_of_minus_128():
    codes = torch.zeros(16, 32, dtype=torch.int8)
    codes[3, 5] = -128
    with pytest.raises(ValueError, match="-127..127"):
        packed_int.pack(packed_int.WideInt8Blocks(codes, torch.ones(16, 1)))


def test_fused_groups_of_both_formats_stack_by_rows():
    gen = torch.Generator().manual_seed(1)
    parts = [_blocks(4, 40, 64, gen), _blocks(8, 24, 64, gen), _blocks(4, 3, 64, gen)]
    x = torch.randn(5, 64, generator=gen)
    flat, weights = packed_int.concat([packed_int.pack(b) for b in parts])  # one parameter, as a fused layer keeps
    assert flat.numel() == sum(w.data.numel() for w in weights)
    assert [w.data.data_ptr() - flat.data_ptr() for w in weights] == [0, weights[0].data.numel(),
                                                                      weights[0].data.numel() + weights[1].data.numel()]
    got = packed_int.packed_linear(x, weights, fp32_out=True).double()
    want = torch.cat([packed_int.reference_linear(x, b) for b in parts], dim=1)
    assert got.shape == (5, 67)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


class _GateUp:
    """What `fuses_silu` reads of a SiLU MLP's [gate; up] layer."""

    def __init__(self, weight: packed_int.PackedWeight, silu: bool = True):
        self.packed_int, self.silu_gate_up, self.bias, self.fp32_out = [weight], silu, None, False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 64, 300])
def test_silu_in_the_product_is_the_plain_product_then_silu_mul(m, bits, dtype):
    """silu(gate) * up computed in the product equals the product written out and then cpu_ops.silu_mul, bit
    for bit, at every row count (the kernels' passes of 8 rows, the 8-bit branchless few-row case)."""
    from fw.kernels import cpu_ops

    cpu_ops.prepare("cpu")
    gen = torch.Generator().manual_seed(m + bits)
    inter, k = 48, 96  # gate and up of 3 tiles each
    weight = packed_int.pack(_blocks(bits, 2 * inter, k, gen))
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    x[:, 5] *= 40  # an outlier channel: heavy blocks too
    layer = _GateUp(weight)
    assert packed_int.fuses_silu(layer)
    fused = packed_int.silu_mul(layer, x)
    plain = cpu_ops.silu_mul(packed_int.packed_linear(x, [weight]))
    assert fused.dtype == dtype and fused.shape == (m, inter)
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def test_silu_fuses_only_whole_tile_halves_of_one_weight():
    gen = torch.Generator().manual_seed(5)
    assert not packed_int.fuses_silu(_GateUp(packed_int.pack(_blocks(4, 48, 64, gen))))  # halves of 24 rows
    assert not packed_int.fuses_silu(_GateUp(packed_int.pack(_blocks(4, 64, 64, gen)), silu=False))  # LoRA on
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.fw_packed_int.silu_q4(torch.randn(1, 64), packed_int.pack(_blocks(4, 48, 64, gen)).data, 48)


def test_leading_dims_and_empty_inputs():
    gen = torch.Generator().manual_seed(2)
    blocks = _blocks(4, 20, 64, gen)
    weight = packed_int.pack(blocks)
    x = torch.randn(2, 3, 64, generator=gen)
    got = packed_int.packed_linear(x, [weight], fp32_out=True)
    assert got.shape == (2, 3, 20)
    torch.testing.assert_close(got.view(6, 20).double(), packed_int.reference_linear(x.view(6, 64), blocks),
                               rtol=1e-5, atol=1e-5)
    assert packed_int.packed_linear(torch.empty(0, 64), [weight]).shape == (0, 20)


def test_layout_is_checked():
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="blocks of 32"):
        packed_int.pack(packed_int.QuantBlocks(8, torch.zeros(16, 48, dtype=torch.int8), torch.ones(16, 1)))
    weight = packed_int.pack(_blocks(4, 16, 64, gen))
    with pytest.raises(RuntimeError, match="does not hold 32 x 64"):
        torch.ops.fw_packed_int.linear_q4(torch.randn(1, 64), weight.data, 32, False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.fw_packed_int.linear_q4(torch.randn(1, 48), weight.data, 16, False)


def test_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")
    assert not packed_int.ready() and not packed_int.applies("cpu", 64)
    assert not packed_int.applies("cpu", 64, widening=True)
    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")
    assert packed_int.applies("cpu", 64) and not packed_int.applies("cpu", 48) and not packed_int.applies("cuda", 64)


def test_ops_trace_under_torch_compile():
    """Shape-only kernels let dynamo and AOTAutograd trace the ops (--enable-torch-compile on a packed model)."""
    from fw.compile import ops

    ops.register_fused_cpu_fakes()
    gen = torch.Generator().manual_seed(4)
    weights = [packed_int.pack(_blocks(4, 40, 64, gen)), packed_int.pack(_blocks(8, 24, 64, gen))]
    if packed_int.applies("cpu", 64, widening=True):
        weights.append(packed_int.pack(_fp8_blocks(8, 64, gen)))

    def f(x):
        return packed_int.packed_linear(x, weights, fp32_out=True) * 2

    x = torch.randn(3, 64, generator=gen)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)
    from fw.layers.packed_embedding import PackedRowEmbedding

    ids = torch.tensor([0, 23, 16])
    for weight in weights[:2]:  # 4-bit and 8-bit rows
        embedding = PackedRowEmbedding(weight, torch.float32)
        assert torch.equal(torch.compile(embedding, fullgraph=True, backend="aot_eager")(ids), embedding(ids))
