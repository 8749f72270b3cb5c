import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the digest cache (engine/files.py) of this test run only: nothing read from or left in the user's
os.environ.setdefault("POLICYSCAN_CACHE_DIR", tempfile.mkdtemp(prefix="policyscan_test_cache_"))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole CPU suite (`python -m pytest -q tests`) on two processes when pytest-xdist is installed (the test
    extra): its tests spend most of their time in single-threaded Python and in child processes, so two processes
    on 2 cores take much less time than one (docs/performance.md). A file's tests stay on one process (their
    module fixtures: the Ray cluster, the sample's CLI runs). Not for chosen tests, -n, --dist, --pdb or --trace
    given, on a GPU machine (its tests would share the GPU), or with one CPU."""
    opt = config.option
    if (not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER")
            or getattr(opt, "numprocesses", None) is not None or getattr(opt, "dist", "no") != "no"
            or getattr(opt, "usepdb", False) or getattr(opt, "trace", False) or _has_cuda()
            or len(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else [os.cpu_count()]) < 2
            or [a for a in config.args if Path(a).resolve() != Path(__file__).resolve().parent]):
        return
    config.option.numprocesses, config.option.dist = 2, "loadfile"
    config.option.loadscopereorder = False  # LONGEST_FIRST's order, not xdist's (most tests first)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in its CPU interpreter; this must be set before any kernel is defined.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
SLICE_ROWS = 40  # the CLI tests score this many of the sample's 200 conversations (same rows, same order)
LABELED_ROWS = 80  # calibrate's labeled slice: 27 pii violations, so >= 10 of each class in the fit rows


@pytest.fixture(scope="session")
def sample_slice(tmp_path_factory) -> dict[str, Path]:
    """The first SLICE_ROWS rows of the sample conversations as Parquet and JSONL (the same conversations and
    ids as sample_data/conversations.*), and the first LABELED_ROWS of labeled.parquet; written once a test run."""
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("sample_slice")
    parquet, jsonl, labeled = root / "conversations.parquet", root / "conversations.jsonl", root / "labeled.parquet"
    pq.write_table(pq.read_table(SAMPLE / "conversations.parquet").slice(0, SLICE_ROWS), parquet)
    lines = (SAMPLE / "conversations.jsonl").read_text().splitlines(keepends=True)
    jsonl.write_text("".join(lines[:SLICE_ROWS]))
    pq.write_table(pq.read_table(SAMPLE / "labeled.parquet").slice(0, LABELED_ROWS), labeled)
    return {"parquet": parquet, "jsonl": jsonl, "labeled": labeled, "rows": SLICE_ROWS}


# The files whose tests take longest on 2 cores, longest first (seconds summed idle, from `--durations=0`):
# xdist hands a process the next file when its queue runs low, so the two end together. xdist's own order (most
# tests first, skipped GPU tests counted) handed out the Ray tests last, which then ran alone (docs/performance.md).
LONGEST_FIRST = ("test_train.py",  # 58
                 "test_kernels.py",  # 36
                 "test_engine_vs_hf.py",  # 32
                 "test_ray.py",  # 30
                 "test_determinism.py",  # 24
                 "test_workers.py",  # 24
                 "test_gemma3_real.py",  # 22
                 "test_gemma2_granite.py",  # 21
                 "test_real_model.py",  # 18
                 "test_row_amax.py",  # 17
                 "test_cli_failures.py",  # 14
                 "test_calibration.py",  # 12
                 "test_gemma3.py",  # 12
                 "test_cli.py")  # 11


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
