"""tools.results_store merge: a device call's rows, appended with their paths moved and the commit that ran."""

from __future__ import annotations

from pathlib import Path

from tools import results_store


def _row(**values: str) -> dict[str, str]:
    return {"kind": "throughput", "call": "c1", "mode": "single", "parity": "pass", **values}


def test_merge_appends_only_the_calls_rows_with_paths_moved(tmp_path: Path) -> None:
    store = tmp_path / "runs.csv"
    results_store.append_rows([_row(raw="benchmarks/results/a.csv")], store)
    device = tmp_path / "device.csv"
    device.write_bytes(store.read_bytes())  # the call's copy, then what it appended
    results_store.append_rows([_row(raw="/root/out/sweep/sweep.csv", parity_file="/root/out/parity/parity.csv",
                                    commit="stale"),
                               _row(raw="/elsewhere/x.csv", commit="stale")], device)
    results_store.append_rows([_row(raw="benchmarks/results/b.csv")], store)  # landed meanwhile: id 2 taken

    ids = results_store.main(["merge", str(device), "--folder", str(results_store.ROOT / "benchmarks/results/k"),
                              "--commit", "abc1234", "--store", str(store)])
    assert ids == 0
    rows = results_store.read_rows(store)
    assert [r["id"] for r in rows] == ["1", "2", "3", "4"]
    assert rows[2]["raw"] == "benchmarks/results/k/sweep/sweep.csv"
    assert rows[2]["parity_file"] == "benchmarks/results/k/parity/parity.csv"
    assert rows[3]["raw"] == "/elsewhere/x.csv"
    assert {r["commit"] for r in rows[2:]} == {"abc1234"}
