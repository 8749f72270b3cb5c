"""CUDA-graph padding, checked on the CPU: a batch copied into larger buffers (a padding sequence of the
spare tokens with adapter -1, empty sequence slots) gives bitwise the f of the batch alone. The capture and
replay themselves are GPU tests (test_gpu_engine.py)."""
from __future__ import annotations

import pytest
import torch
from hf_fixtures import make_bundle

from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.loader import attach_policies, load_decoder
from policyscan.engine.model.precision import Precision
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.batch import pack
from policyscan.engine.run.graphs import fill, static_batch
from policyscan.kernels import reference

LABELS = [(3, 7), (11, 5), (20, 21)]


@pytest.fixture(scope="module")
def dec(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    dirs = make_bundle(root, "llama")
    d = load_decoder(Checkpoint.open(root / "model"), reference, Precision(torch.float32))
    attach_policies(d, [load_policy(p) for p in dirs], LABELS)
    return d


@pytest.mark.parametrize("with_prefix", [False, True])
def test_padded_batch_gives_bitwise_the_same_f(dec, with_prefix):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    prefix = dec.prefill_prefixes([[1, 2, 3], [], [4, 5, 6, 7, 8, 9]]) if with_prefix else None
    for lengths, (Tp, Bp) in [([1], (64, 8)), ([5, 17, 3], (32, 8)), ([9, 2, 30, 1], (42, 5)), ([16] * 4, (64, 8))]:
        seqs = [torch.randint(0, 211, (n,), generator=g).tolist() for n in lengths]
        batch = pack(seqs, sorted(torch.randint(0, 3, (len(seqs),), generator=g).tolist()))
        static = static_batch(Tp, Bp, "cpu")
        fill(static, batch)
        f = dec.forward(static, prefix)
        assert f.shape == (Bp,) and torch.isfinite(f).all()
        assert torch.equal(f[:batch.num_seqs], dec.forward(batch, prefix)), lengths


def test_a_batch_that_does_not_fit_is_refused():
    batch = pack([[1, 2, 3], [4]], [0, 1])
    with pytest.raises(ValueError, match="does not fit"):
        fill(static_batch(3, 8, "cpu"), pack([[1, 2, 3, 4]], [0]))
    with pytest.raises(ValueError, match="padding sequence"):
        fill(static_batch(64, 2, "cpu"), batch)
