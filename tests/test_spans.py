"""Rank spans of stacked LoRA B (kernels/spans.py): where B can be nonzero, and the Gluon GEMM's expand through
them giving the same bits as the whole expand."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import gemm_case, gen

from policyscan.engine.model.layers import DenseLoraLinear, LoraStack, Prologue
from policyscan.kernels import reference
from policyscan.kernels.spans import ALIGN, RankSpans, rank_spans


def block_diagonal(ranks: list[int], outs: list[int], n: int, g: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """B [n, sum(outs), sum(ranks)] as engine.loader stacks q, k and v: projection p's rows use its ranks only;
    some adapters leave a projection out (zero rows), as a policy without that projection does."""
    B = torch.zeros(n, sum(outs), sum(ranks), dtype=dtype)
    r0 = o0 = 0
    for r, o in zip(ranks, outs):
        for a in range(n):
            if r and (a == 0 or torch.rand((), generator=g) < 0.7):
                k = int(torch.randint(1, r + 1, (), generator=g))  # a lower rank, padded with zeros
                B[a, o0:o0 + o, r0:r0 + k] = torch.randn(o, k, generator=g) / k ** 0.5
        r0, o0 = r0 + r, o0 + o
    return B


def assert_spans_hold(B: torch.Tensor, spans: RankSpans) -> None:
    """B is zero outside each block's span, and each span starts on a 16-rank boundary."""
    for blk, start in enumerate(spans.start.tolist()):
        cols = B[:, blk * spans.cols:(blk + 1) * spans.cols]
        outside = torch.ones(B.shape[2], dtype=torch.bool)
        if start >= 0:
            assert start % ALIGN == 0
            outside[start:start + spans.width] = False
        assert not cols[:, :, outside].any(), f"block {blk}: nonzero ranks outside [{start}, +{spans.width})"


@pytest.mark.parametrize("ranks,outs,cols,expect", [
    ([16, 16, 16], [256, 128, 128], 128, ([0, 0, 16, 32], 16)),           # W1's qkv, per head
    ([8, 8, 8], [128, 64, 64], 64, ([0, 0, 0, 16], 16)),                  # unaligned: k's ranks 8-15 start at 0
    ([16, 0, 16], [128, 128, 128], 128, ([0, -1, 16], 16)),               # no adapter has k: no expand there
    ([32, 32, 32], [300, 100, 100], 128, ([0, 0, 0, 32], 64)),            # blocks straddling q / k and k / v
    ([4, 0, 4], [128, 128, 128], 128, None),                              # one 16-rank MMA already
])
def test_rank_spans(ranks, outs, cols, expect):
    B = block_diagonal(ranks, outs, 5, gen())
    spans = rank_spans(B, cols)
    if expect is None:
        assert spans is None
        return
    start, width = expect
    assert spans is not None and spans.width == width and spans.start.tolist() == start
    assert_spans_hold(B, spans)


def test_rank_spans_of_a_dense_or_interleaved_stack_is_none():
    g = gen()
    assert rank_spans(torch.randn(3, 500, 48, generator=g)) is None
    B = block_diagonal([16, 16], [256, 256], 4, g)  # gate / up, then interleaved as the SiLU epilogue reads them
    assert rank_spans(reference.interleave_halves(B, dim=1)) is None


def test_rank_spans_narrow_and_validation():
    spans = rank_spans(block_diagonal([16, 16, 16], [384, 128, 128], 2, gen()))
    assert spans.narrow(384, 256).start.tolist() == [16, 32]
    assert spans.narrow(0, 384).start.tolist() == [0, 0, 0]
    assert spans.narrow(100, 28) is None
    with pytest.raises(ValueError, match="power of two"):
        RankSpans(spans.start, 24, 128)
    with pytest.raises(ValueError, match="int32"):
        RankSpans(spans.start.long(), 16, 128)


def test_layer_keeps_spans_for_qkv_not_gate_up():
    g = gen()
    K = 64
    B = block_diagonal([16, 16, 16], [256, 128, 128], 3, g)
    A = torch.randn(3, 48, K, generator=g)
    qkv = DenseLoraLinear(torch.randn(512, K, generator=g), None, Prologue(), reference)
    qkv.set_lora(LoraStack(A, B))
    assert qkv.spans is not None and qkv.spans.start.tolist() == [0, 0, 16, 32]
    gate_up = DenseLoraLinear(torch.randn(512, K, generator=g), None, Prologue(), reference, silu_out=True)
    gate_up.set_lora(LoraStack(A[:, :32], block_diagonal([16, 16], [256, 256], 3, g)))
    assert gate_up.spans is None
    qkv.set_lora(None)
    assert qkv.spans is None


# (M, [q, k, v ranks], [q, k, v out], adapters): W1's qkv rows; unaligned ranks; no k; stacks past 64 (spans of
# 32 at rank 96; of 64 at 192; of 128 at 160, in the expand's 64-rank pieces)
GPU_SPAN_CASES = [(4099, [16, 16, 16], [3072, 1024, 1024], 8), (2000, [8, 8, 8], [1024, 256, 256], 128),
                  (1500, [16, 0, 16], [512, 256, 256], 16), (3000, [32, 32, 32], [1024, 512, 512], 16),
                  (1100, [64, 64, 64], [512, 256, 256], 64), (1025, [128, 16, 16], [256, 128, 128], 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
def test_gluon_expand_through_spans_is_bitwise_the_whole_expand(residual):
    """The Gluon kernel with spans gives the bits of the Triton kernel's whole expand (and of itself without
    spans), on block-diagonal stacks with adapters missing projections and gaps of absent adapter ids."""
    from policyscan.kernels import lora_gemm_ws
    from policyscan.kernels.lora_gemm import lora_gemm
    g = gen()
    for M, ranks, outs, n_ad in GPU_SPAN_CASES:
        N, K = sum(outs), 1024
        case, _ = gemm_case(M, N, K, sum(ranks), n_ad, torch.bfloat16, True, residual, False, g, "cuda")
        case["B"] = block_diagonal(ranks, outs, n_ad, g, torch.bfloat16).cuda()
        spans = rank_spans(case["B"])
        assert spans is not None, (ranks, outs)
        assert_spans_hold(case["B"].cpu(), RankSpans(spans.start.cpu(), spans.width, spans.cols))
        whole = lora_gemm(**case, out_dtype=torch.bfloat16, config={"TMA": True, "PERSISTENT": True})
        for use in (spans, None):
            y = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            lora_gemm_ws.lora_gemm_ws(*case.values(), y, spans=use)
            assert torch.equal(y, whole), f"M={M} ranks={ranks} outs={outs} spans={use is not None}"
        assert torch.equal(lora_gemm(**case, out_dtype=torch.bfloat16, spans=spans), whole)
