import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the digest cache (engine/files.py) of this session only: nothing read from or left in the user's
os.environ.setdefault("POLICYSCAN_CACHE_DIR", tempfile.mkdtemp(prefix="policyscan_test_cache_"))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in its CPU interpreter; this must be set before any kernel is defined.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"
SLICE_ROWS = 40  # the CLI tests score this many of the sample's 200 conversations (same rows, same order)
LABELED_ROWS = 80  # calibrate's labeled slice: 27 pii violations, so >= 10 of each class in the fit rows


@pytest.fixture(scope="session")
def sample_slice(tmp_path_factory) -> dict[str, Path]:
    """The first SLICE_ROWS rows of the sample conversations as Parquet and JSONL (the same conversations and
    ids as sample_data/conversations.*), and the first LABELED_ROWS of labeled.parquet; written once a session."""
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("sample_slice")
    parquet, jsonl, labeled = root / "conversations.parquet", root / "conversations.jsonl", root / "labeled.parquet"
    pq.write_table(pq.read_table(SAMPLE / "conversations.parquet").slice(0, SLICE_ROWS), parquet)
    lines = (SAMPLE / "conversations.jsonl").read_text().splitlines(keepends=True)
    jsonl.write_text("".join(lines[:SLICE_ROWS]))
    pq.write_table(pq.read_table(SAMPLE / "labeled.parquet").slice(0, LABELED_ROWS), labeled)
    return {"parquet": parquet, "jsonl": jsonl, "labeled": labeled, "rows": SLICE_ROWS}


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
