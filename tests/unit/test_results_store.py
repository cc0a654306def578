"""tools.results_store merge: a device call's rows, appended with their paths moved and the commit that ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import results_store


def _row(**values: str) -> dict[str, str]:
    return {"kind": "throughput", "call": "c0", "mode": "single", "parity": "pass", **values}


def test_merge_appends_the_calls_rows_with_paths_moved(tmp_path: Path) -> None:
    store = tmp_path / "runs.csv"
    results_store.append_rows([_row(raw="benchmarks/results/a.csv"), _row(raw="benchmarks/results/b.csv")], store)
    device = tmp_path / "device.csv"
    device.write_bytes(store.read_bytes())  # the call's copy, then what it appended
    results_store.append_rows([_row(call="c1", raw="/root/out/sweep/sweep.csv",
                                    parity_file="/root/out/parity/parity.csv", commit="stale"),
                               _row(call="c1", raw="/elsewhere/x.csv", commit="stale")], device)
    rows = results_store.read_rows(store)
    rows[0]["superseded_by"] = "2"  # edited here after the copy was taken
    store.unlink()
    results_store.append_rows([{k: v for k, v in r.items() if k != "id"} for r in rows], store)
    results_store.append_rows([_row(raw="benchmarks/results/c.csv")], store)  # landed meanwhile: id 3 taken

    rc = results_store.main(["merge", str(device), "--call", "c1", "--folder",
                             str(results_store.ROOT / "benchmarks/results/k"), "--commit", "abc1234",
                             "--store", str(store)])
    assert rc == 0
    rows = results_store.read_rows(store)
    assert [(r["id"], r["call"]) for r in rows] == [("1", "c0"), ("2", "c0"), ("3", "c0"), ("4", "c1"), ("5", "c1")]
    assert rows[3]["raw"] == "benchmarks/results/k/sweep/sweep.csv"
    assert rows[3]["parity_file"] == "benchmarks/results/k/parity/parity.csv"
    assert rows[4]["raw"] == "/elsewhere/x.csv"
    assert {r["commit"] for r in rows[3:]} == {"abc1234"}
    with pytest.raises(SystemExit):  # merged once: a second merge would hold its rows twice
        results_store.main(["merge", str(device), "--call", "c1", "--folder", str(tmp_path), "--commit", "x",
                            "--store", str(store)])


def test_a_summary_row_names_the_commit_that_ran_where_given() -> None:
    summary = {"mode": "hybrid", "world_size": 4, "simulated": True}
    assert results_store.row_from_summary(summary, call="c1", raw="r.csv", commit="abc1234")["commit"] == "abc1234"
    assert results_store.row_from_summary(summary, call="c1", raw="r.csv")["commit"] == results_store.git_commit()
