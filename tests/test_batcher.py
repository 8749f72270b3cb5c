"""Packing: every prompt lands in exactly one batch, under the token budget, grouped by adapter."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyscan.engine.run.batch import pack, plan_batches


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 5)), min_size=0, max_size=300), st.integers(64, 500))
def test_plans_cover_every_prompt_once_under_the_budget(items, budget):
    lengths = np.array([n for n, _ in items], dtype=np.int64)
    adapters = np.array([a for _, a in items], dtype=np.int64)
    plans = list(plan_batches(lengths, adapters, budget))
    seen = np.concatenate([p.items for p in plans]) if plans else np.array([], dtype=np.int64)
    assert sorted(seen.tolist()) == list(range(len(items)))
    for p in plans:
        assert 0 < p.tokens == lengths[p.items].sum() <= budget
        assert (np.diff(adapters[p.items]) >= 0).all()  # one run per adapter: GEMM tiles usually see one
    # a plan is closed only when the next prompt would not fit (no half-empty batches in the middle)
    for p, nxt in zip(plans, plans[1:]):
        assert p.tokens + lengths[nxt.items].min() > budget


def test_a_prompt_over_the_budget_is_refused():
    with pytest.raises(ValueError, match="exceeds the batch budget"):
        list(plan_batches(np.array([10, 600]), np.array([0, 1]), 512))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_pack_metadata(lengths):
    seqs = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]
    ads = [i % 3 for i in range(len(seqs))]
    b = pack(seqs, ads)
    assert b.ids.tolist() == [t for s in seqs for t in s]
    assert b.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert b.positions.tolist() == [i for n in lengths for i in range(n)]
    assert b.token_adapter.tolist() == [a for a, n in zip(ads, lengths) for _ in range(n)]
    assert b.last_idx.tolist() == (np.cumsum(lengths) - 1).tolist() and b.max_seqlen == max(lengths)
    with pytest.raises(ValueError):
        pack(seqs + [[]], ads + [0])
    with pytest.raises(ValueError):
        pack(seqs, ads[:-1] if len(ads) > 1 else ads + [1])
    assert torch.equal(b.to("cpu").ids, b.ids)
    tensors = pack([torch.tensor(s) for s in seqs], ads)  # the same batch from tensors (the other path)
    assert all(torch.equal(getattr(tensors, f), getattr(b, f)) for f in ("ids", "cu_seqlens", "positions"))
    assert b.ids.dtype == torch.int64
