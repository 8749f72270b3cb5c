"""The pages as a person sees them: opened in headless Chromium (Debian's package, which .ci/run installs), they
render with no console message (the pages' content security policy makes any load attempt one), the numbers the
browser shows are the output's, and the plots are drawn."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_cases import SAMPLE, run
from report_cases import number, page_figures, score

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                                              "(apt-get install chromium; .ci/run installs it)")
BAR = np.array([0x4C, 0x86, 0xC6]) / 255.0  # the histogram bars' fill (report/page.py)


def _chromium(tmp: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr", "--log-level=0", *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def _console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def scored(tmp_path_factory, sample_slice):
    root = tmp_path_factory.mktemp("browser")
    out = score(sample_slice["labeled"], root / "labeled.scores.parquet", "--raw", "--keep", "pii")
    return root, out


def test_report_renders_with_the_outputs_numbers(scored, tmp_path):
    _, out = scored
    page = tmp_path / "report.html"
    run("report", out, "-o", page, "--inputs", "--top", 5)
    res = _chromium(tmp_path, page, "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    assert not _console(res.stderr), _console(res.stderr)
    fig = page_figures(res.stdout)  # the document as the browser built it
    t = pq.read_table(out)
    for name in ("pii", "investment_advice"):
        assert number(fig[("flagged", name)]) == int((np.array(t.column(f"p_{name}").to_pylist()) >= 0.5).sum())
    assert number(fig[("rows_scored",)]) == t.num_rows
    assert res.stdout.count("<svg") == 2 and "policyscan report" in res.stdout
    shot = tmp_path / "report.png"
    res = _chromium(tmp_path, page, f"--screenshot={shot}", "--window-size=1200,1400")
    assert res.returncode == 0 and not _console(res.stderr), res.stderr[-2000:]
    import matplotlib.image

    img = matplotlib.image.imread(shot)[..., :3]
    assert img.shape[:2] == (1400, 1200) and img.std() > 0.05  # not a blank page
    bars = np.all(np.abs(img - BAR) < 0.03, axis=-1).sum()
    assert bars > 200, f"{bars} pixels of the histograms' bars: the plots did not render"


def test_evaluate_page_renders(scored, tmp_path):
    root, out = scored
    page = tmp_path / "evaluate.html"
    run("evaluate", out, "--policy", SAMPLE / "policies" / "pii", "--from-scores", "--max-f1", "--bootstrap", 20,
        "-o", page)
    res = _chromium(tmp_path, page, "--dump-dom")
    assert res.returncode == 0 and not _console(res.stderr), res.stderr[-2000:]
    fig = page_figures(res.stdout)
    t = pq.read_table(out)
    p, y = np.array(t.column("p_pii").to_pylist()), np.array(t.column("pii").to_pylist()).astype(bool)
    assert number(fig[("tp", "pii")]) == int((y & (p >= 0.5)).sum())
    assert number(fig[("fn", "pii")]) == int((y & (p < 0.5)).sum())
    assert res.stdout.count("<svg") == 3  # reliability, ROC, precision-recall
