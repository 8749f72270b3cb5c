"""policyscan on Ray (policyscan.ray, `score --ray`) on a local two-CPU Ray cluster: the local CLI's outputs bit for
bit, every row back (scored or with its error), skipped when up to date, nothing lost when an actor is killed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from cli_cases import SAMPLE, run  # noqa: E402
from faults import actor_killer  # noqa: E402

from policyscan.cli.main import cli  # noqa: E402
from policyscan.engine.settings import EngineSettings  # noqa: E402
from policyscan.ray import PolicyScorer  # noqa: E402
from policyscan.ray import run as run_mod  # noqa: E402

SETTINGS = EngineSettings("cpu", batch_tokens=4096, max_length=256, threads=1)
CPU = ["--device", "cpu", "--batch-tokens", "4096", "--max-length", "256", "--threads", "1", "--raw", "--no-progress"]


@pytest.fixture(scope="module")
def arm(tmp_path_factory):
    """A local Ray cluster for the module, whose worker processes kill an actor at its second batch while the file
    this yields exists (faults.actor_killer)."""
    path = tmp_path_factory.mktemp("kill") / "arm"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"},
                          "worker_process_setup_hook": actor_killer(path)})
    yield path
    ray.shutdown()


@pytest.fixture
def armed(arm):
    """The kill armed for one test, and disarmed after it whatever happened (a run failing before the kill would
    leave it armed for the next test's actor)."""
    arm.touch()
    yield arm
    arm.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def inputs(sample_slice, tmp_path_factory) -> list[Path]:
    """The sample slice as Parquet of 5 row groups (5 units: 5 batches), 12 JSONL lines with bad ones and
    conversations too long to keep whole (clipped), and 6 rows whose ids are integers (no batch may join them with
    the others' string ids)."""
    d = tmp_path_factory.mktemp("ray_in")
    pq.write_table(pq.read_table(sample_slice["parquet"]), d / "logs.parquet", row_group_size=8)
    lines = sample_slice["jsonl"].read_text().splitlines()[:12]
    lines[2], lines[7] = "{not json", '{"id": "x", "messages": []}'
    lines[10] = json.dumps({"id": "long", "messages": [{"role": "user", "content": "word " * 14000}]})
    # clipped to its last characters, all blank: still the conversation the reader checked whole
    lines[11] = json.dumps({"id": "blank-tail", "messages": [{"role": "user", "content": "my SSN?" + " " * 70000}]})
    (d / "more.jsonl").write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n")
    head = pq.read_table(sample_slice["parquet"]).slice(0, 6)
    pq.write_table(head.set_column(head.schema.get_field_index("id"), "id", pa.array(range(6), pa.int64())),
                   d / "ints.parquet")
    return [d / "logs.parquet", d / "more.jsonl", d / "ints.parquet"]


@pytest.fixture(scope="module")
def local(inputs, tmp_path_factory) -> Path:
    """The local CLI's outputs of `inputs`, one per input."""
    out = tmp_path_factory.mktemp("local")
    run("score", *inputs, "-o", f"{out}/", *CPU, ok=(3,))
    return out


def _meta(path: Path) -> dict:
    return json.loads(pq.ParquetFile(path).metadata.metadata[b"policyscan"])


def _same_run(a: dict, b: dict) -> None:
    """Metadata of one run's output, made locally and on Ray: equal but for times, paths and Ray's own record."""
    assert {k for k in a if k not in ("ray", "errors_file")} == set(b) - {"errors_file"}
    assert a["written_at"] and b["written_at"]  # when each was committed
    for k in b:
        if k == "accounting":
            assert {x: v for x, v in a[k].items() if "seconds" not in x} == \
                   {x: v for x, v in b[k].items() if "seconds" not in x}
        elif k not in ("errors_file", "written_at"):
            assert a[k] == b[k], k


@pytest.mark.slow
def test_score_on_ray_with_an_actor_killed_writes_the_local_outputs_bit_for_bit_and_skips_them_next_time(
        armed, inputs, local, tmp_path):
    """The actor SIGKILLs itself at its second batch: Ray restarts it and runs the batch again, and no
    row is lost or doubled. One killed run, not a run of its own: an actor's start is most of a run's 10 s."""
    out = tmp_path  # as deep as `local`: the inputs' paths relative to the outputs are the same
    res = run("score", *inputs, "-o", f"{out}/", *CPU, "--ray", ok=(3,))
    assert not armed.exists()  # an actor was killed
    assert "rows in 58 = scored 56 + in errors 2 (balanced)" in res.output, res.output
    for name in ("logs.scores.parquet", "more.scores.parquet", "ints.scores.parquet"):
        assert pq.read_table(out / name).equals(pq.read_table(local / name)), name
        _same_run(_meta(out / name), _meta(local / name))
        assert _meta(out / name)["ray"]["actors"] == 1
    assert _meta(out / "more.scores.parquet")["accounting"]["clipped_conversations"] == 2
    errors = (out / "more.scores.parquet.errors.jsonl").read_text()
    assert errors == (local / "more.scores.parquet.errors.jsonl").read_text()
    assert [json.loads(e)["line"] for e in errors.splitlines()] == [3, 9]  # the blank line 6 is no row
    # again, from a driver process that cannot import torch: two outputs up to date, the third scored again
    (out / "ints.scores.parquet").unlink()
    res = subprocess.run([sys.executable, "-c", NO_TORCH, "score", *map(str, inputs), "-o", f"{out}/", *CPU, "--ray",
                          "--ray-address", ray.get_runtime_context().gcs_address], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("up to date") == 2 and "rows in 6 = scored 6 + in errors 0 (balanced)" in res.stdout
    assert pq.read_table(out / "ints.scores.parquet").equals(pq.read_table(local / "ints.scores.parquet"))
    assert pq.read_table(out / "ints.scores.parquet")["id"].type == pa.int64()
    res = run("score", *inputs, "-o", f"{out}/", *CPU, "--ray")  # nothing new: no unit goes to Ray, exit 0
    assert res.output.count("up to date") == 3 and "rows in 0 =" in res.output


def test_a_row_that_does_not_come_back_from_ray_fails_its_output_by_name(arm, inputs, local, tmp_path, monkeypatch):
    """A row lost on the way back (here: dropped from one returned chunk, as a lost retry would) fails that output
    by its file, though its row count would balance; the outputs before it are written, it and those after are not."""
    unpack, dropped = run_mod.unpack, []

    def lossy(batch):
        tables = unpack(batch)
        for i, t in enumerate(tables):
            src = t.column("_policyscan_source").to_pylist()
            if not dropped and "more" in src[0]["file"] and t.num_rows > 2:
                dropped.append(src[1])
                tables[i] = pa.concat_tables([t.slice(0, 1), t.slice(2)])
        return tables

    monkeypatch.setattr(run_mod, "unpack", lossy)
    res = run("score", *inputs, "-o", f"{tmp_path}/", *CPU, "--ray", ok=(1,))
    assert dropped, "no chunk of more.jsonl came back with rows to drop"
    assert "more.jsonl: the part from file row 0 came back with rows out of place" in res.output, res.output
    assert "the output is not written" in res.output
    assert pq.read_table(tmp_path / "logs.scores.parquet").equals(pq.read_table(local / "logs.scores.parquet"))
    assert not [p.name for p in tmp_path.glob("more.scores.parquet*")] + [p.name for p in tmp_path.glob("ints.*")]


# the command line with torch unimportable: `score --ray` plans, checks and writes without it (1.2-1.5 s of import)
NO_TORCH = "import sys; sys.modules['torch'] = None\nfrom policyscan.cli.main import main; main()"


def test_the_ray_driver_imports_no_torch():
    """Though torch is installed: a fallback import would pass the run above."""
    code = "import sys, policyscan.cli.main, policyscan.cli.score, policyscan.ray.run; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


@pytest.mark.slow
def test_policy_scorer_in_a_users_pipeline_keeps_every_row(arm, inputs, local, tmp_path):
    """read_parquet -> map_batches(PolicyScorer): p bitwise the CLI's; a row that cannot be scored comes back with
    its error, never dropped."""
    rows = pq.read_table(inputs[0]).to_pylist()
    rows[4]["messages"], rows[30]["messages"] = None, [{"role": "user"}]
    src = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    ds = ray.data.read_parquet(str(src)).map_batches(
        PolicyScorer, fn_constructor_kwargs={"model": str(SAMPLE / "model"), "policies": [str(SAMPLE / "policies")],
                                             "settings": SETTINGS, "raw": True},
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1, batch_size=16, batch_format="pyarrow")
    got = pa.concat_tables(ds.iter_batches(batch_size=None, batch_format="pyarrow")).sort_by("id")
    assert got["id"].to_pylist() == sorted(r["id"] for r in rows)
    bad = got.filter(pc.is_valid(got["error"]))
    assert bad["id"].to_pylist() == sorted([rows[4]["id"], rows[30]["id"]]) and bad["p_pii"].null_count == 2
    assert "null conversation" in bad["error"].to_pylist()[bad["id"].to_pylist().index(rows[4]["id"])]
    want = pq.read_table(local / "logs.scores.parquet").sort_by("id")
    scored = got.filter(pc.is_null(got["error"])).select(want.column_names)
    assert scored.equals(want.filter(pc.is_in(want["id"], scored["id"])))


def test_policy_scorer_forms_file_row_ids_and_passes_upstream_errors_through():
    scorer = PolicyScorer(SAMPLE / "model", [SAMPLE / "policies" / "pii"], SETTINGS, text_column="t",
                          error_column="why", keep=("tag",), truncation=True)
    batch = pa.table({"t": ["user: hello there", None, "user: again", "  "],
                      "why": [None, "upstream reason", None, None],
                      "path": ["/a/day1.parquet"] * 4, "row": [10, 11, 12, 13], "tag": ["w", "x", "y", "z"]})
    out = scorer(batch)
    assert out["id"].to_pylist() == ["day1.parquet:10", "day1.parquet:11", "day1.parquet:12", "day1.parquet:13"]
    assert out["error"].to_pylist() == [None, "upstream reason", None, "empty conversation"]
    assert out["tag"].to_pylist() == ["w", "x", "y", "z"] and out["p_pii"].null_count == 2
    assert out["truncated_pii"].to_pylist() == [False, None, False, None]
    assert out["prompt_tokens"].to_pylist()[1::2] == [0, 0] and min(out["prompt_tokens"].to_pylist()[::2]) > 0
    with pytest.raises(Exception, match="no column 'id', nor 'path' and 'row'"):
        scorer(batch.drop_columns(["row"]))


def test_a_bad_policy_stops_a_ray_run_before_it_connects(inputs, tmp_path, monkeypatch):
    monkeypatch.setattr(run_mod, "connect", lambda address: pytest.fail("connected"))
    res = CliRunner().invoke(cli, ["score", str(inputs[0]), "-o", f"{tmp_path}/", *CPU, "--policies",
                                   str(tmp_path / "nowhere"), "--ray"])
    assert res.exit_code == 1 and "nowhere: no such policy bundle or folder" in res.output
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("joined", [True, False])
def test_a_ray_run_failing_after_the_connect_disconnects_only_what_it_joined(inputs, tmp_path, monkeypatch, joined):
    """Ray is shut down when this run joined the cluster, whatever failed after; a host application's connection
    is left to it."""
    calls = []

    class FakeRay:
        def shutdown(self):
            calls.append("shutdown")

    monkeypatch.setattr(run_mod, "connect", lambda address: (FakeRay(), joined))
    res = CliRunner().invoke(cli, ["score", str(inputs[0]), "-o", f"{tmp_path}/", *CPU, "--devices", "1", "--ray"])
    assert res.exit_code == 2 and "--devices picks GPUs of this host" in res.output
    assert calls == (["shutdown"] if joined else []) and not list(tmp_path.iterdir())


@pytest.mark.parametrize("order", ["flag first", "flag last", "address first"])
def test_ray_options_go_in_any_order(inputs, tmp_path, monkeypatch, order):
    """--ray is a flag and --ray-address names the cluster, so neither takes an input for its value."""
    addresses = []

    def connect(address):
        addresses.append(address)
        raise SystemExit(0)

    monkeypatch.setattr(run_mod, "connect", connect)
    args = {"flag first": ["--ray", str(inputs[0]), "-o", f"{tmp_path}/"],
            "flag last": [str(inputs[0]), "-o", f"{tmp_path}/", "--ray"],
            "address first": ["--ray-address", "HEAD:6379", str(inputs[0]), "-o", f"{tmp_path}/"]}[order]
    res = CliRunner().invoke(cli, ["score", *args, *CPU])
    assert res.exit_code == 0 and addresses == ["HEAD:6379" if order == "address first" else ""], res.output


def test_the_old_ray_address_form_says_what_to_type(inputs, tmp_path):
    res = CliRunner().invoke(cli, ["score", "--ray", "HEAD:6379", str(inputs[0]), "-o", f"{tmp_path}/", *CPU])
    assert res.exit_code == 2 and "--ray-address HEAD:6379" in res.output


@pytest.mark.parametrize("kept", ["prompt_tokens", "error", "clipped", "_policyscan_text"])
def test_a_kept_column_named_like_a_ray_scorer_column_is_refused_before_the_connect(inputs, tmp_path, monkeypatch,
                                                                                    kept):
    monkeypatch.setattr(run_mod, "connect", lambda address: pytest.fail("connected"))
    res = CliRunner().invoke(cli, ["score", str(inputs[0]), "-o", f"{tmp_path}/", *CPU, "--keep", kept, "--ray"])
    assert res.exit_code == 2 and f"--keep {kept} collides with the output column" in res.output, res.output


def test_policy_scorer_refuses_a_kept_column_it_would_replace():
    with pytest.raises(Exception, match="--keep prompt_tokens collides"):
        PolicyScorer(SAMPLE / "model", [SAMPLE / "policies"], SETTINGS, keep=["prompt_tokens"])
