"""The warm-up at load (engine/warmup.py): which batches it runs, and that it changes no result."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from policyscan.engine.warmup import synthetic_batch, warm_shapes

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"


def test_warm_shapes_cover_eager_residues_last_layer_tiles_and_graph_buckets():
    shapes = warm_shapes(16384, (256, 4096))
    eager = [s for s in shapes if s[0] > 4096]
    assert {t % 16 == 0 for t, _ in eager} == {True, False}
    assert {b % 16 == 0 for _, b in eager} == {True, False}
    assert sorted({-(-b // 128) for _, b in eager}) == [1, 2, 3, 4, 5]  # the last layer's row tiles
    assert [t for t, _ in shapes if t <= 4096] == [256, 512, 1024, 2048, 4096]
    # a budget the graphs cover: no eager batch; a budget between buckets still meets the bucket above it
    assert [t for t, _ in warm_shapes(4096, (256, 4096))] == [256, 512, 1024, 2048, 4096]
    assert [t for t, _ in warm_shapes(600, (256, 4096))] == [256, 512, 1024]
    # no graphs: every batch eager, above and below the FP8 GEMM's 2048-row switch
    plain = warm_shapes(16384, None)
    assert any(t > 2048 for t, _ in plain) and any(t <= 2048 for t, _ in plain)
    assert {t % 16 == 0 for t, _ in plain} == {True, False}


@pytest.mark.parametrize("tokens,seqs,policies", [(4113, 513, 3), (17, 17, 1), (2064, 16, 8)])
def test_synthetic_batch(tokens, seqs, policies):
    b = synthetic_batch(tokens, seqs, policies)
    lens = (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).numpy()
    assert b.ids.numel() == tokens and b.num_seqs == seqs and lens.min() >= 1 and lens.max() - lens.min() <= 1
    ads = b.seq_adapter.numpy()
    assert (np.diff(ads) >= 0).all() and set(ads.tolist()) == set(range(min(policies, seqs)))
    with pytest.raises(ValueError, match="cannot split 3 tokens into 4"):
        synthetic_batch(3, 4, 1)


def test_warm_up_changes_no_score():
    """The warm-up runs at load on a GPU only; run by hand on the CPU it leaves every score bitwise the same."""
    from policyscan.engine.policy import load_policies
    from policyscan.engine.runner import Engine, EngineSettings

    engine = Engine(SAMPLE / "model", load_policies([SAMPLE / "policies"]), EngineSettings("cpu", batch_tokens=2048))
    g = torch.Generator().manual_seed(3)
    convs = [torch.randint(3, 1000, (int(n),), generator=g).numpy().astype(np.int32)
             for n in torch.randint(1, 300, (12,), generator=g)]
    before, tokens, _ = engine.score_conversations(convs)
    engine.warm_up()
    after, tokens2, _ = engine.score_conversations(convs)
    assert tokens == tokens2 and np.array_equal(before, after)
