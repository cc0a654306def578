"""The results store and the tables generated from it: the committed README and docs/results.md are the
generator's output, and the generator's rules hold (ratios within one call, unverified and superseded rows
labelled, simulated rows kept out of throughput tables)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import results_tables as rt
from tools.results_store import COLUMNS, MICROBENCH, MICROBENCH_COLUMNS, ROOT, VERDICTS, append_rows, read_rows


def row(id_: int, **kw: str) -> dict[str, str]:
    base = {c: "" for c in COLUMNS}
    base.update(id=str(id_), kind="throughput", date="2026-11-29", call="A", device="NVIDIA H200", gpus="2",
                model="gpt2-large", mode="baseline", engine="torch", tp="1", sp="0", compile="compile",
                kernels="none", batch="8", tokens_per_s="100000", mfu="0.3", peak_gib="20", parity="pass",
                parity_file="benchmarks/results/parity/x/parity.csv", simulated="0")
    base.update(kw)
    return base


def micro(id_: int, **kw: str) -> dict[str, str]:
    base = {c: "" for c in MICROBENCH_COLUMNS}
    base.update(id=str(id_), date="2026-11-25", call="7", device="NVIDIA H100 80GB HBM3", benchmark="kernels",
                op="layernorm fwd+bwd", implementation="eager", shape="[8, 1024, 1280]", metric="ms", value="0.2",
                raw="benchmarks/results/kernels/h100-2026-11-25/kernels.csv")
    base.update(kw)
    return base


def test_committed_docs_are_the_generated_tables() -> None:
    """README.md's headline and docs/results.md's tables are `python -m tools.results_tables` over the stores."""
    rows, micro_rows = rt.by_id(read_rows()), read_rows(MICROBENCH)
    for page in rt.PAGES:
        text = page.read_text()
        assert rt.generate(text, page, rows, micro_rows) == text, (
            f"{page.relative_to(ROOT)} is stale: run python -m tools.results_tables")


def test_store_rows_are_complete_and_point_at_files() -> None:
    rows = read_rows()
    ids = {r["id"] for r in rows}
    assert rows and len(ids) == len(rows)
    for r in rows:
        assert list(r) == list(COLUMNS)
        assert r["parity"] in VERDICTS and r["simulated"] in ("0", "1"), r["id"]
        assert (ROOT / r["raw"]).is_file(), f"row {r['id']}: raw file {r['raw']} is missing"
        assert not r["parity_file"] or (ROOT / r["parity_file"]).is_file(), f"row {r['id']}: {r['parity_file']}"
        assert not r["superseded_by"] or r["superseded_by"] in ids, f"row {r['id']}: no row {r['superseded_by']}"


def test_a_ratio_across_calls_is_refused() -> None:
    a, b = row(1), row(2, call="B", tokens_per_s="50000")
    assert rt.ratio(row(3, tokens_per_s="50000"), a) == 0.5
    with pytest.raises(rt.CrossCallRatio):
        rt.ratio(b, a)
    with pytest.raises(rt.CrossCallRatio):  # the same call name on another day is another call
        rt.ratio(row(4, date="2026-11-28"), a)
    with pytest.raises(rt.CrossCallRatio):
        rt.render(rt.Table([(1, None), (2, 1)]), {1: a, 2: b})


def test_microbench_rows_are_complete_and_point_at_files() -> None:
    """Every microbenchmark number names the committed raw file it was read from, and each table has rows."""
    rows = read_rows(MICROBENCH)
    ids = {r["id"] for r in rows}
    assert rows and len(ids) == len(rows)
    for r in rows:
        assert list(r) == list(MICROBENCH_COLUMNS)
        float(r["value"])
        assert r["call"] and r["device"] and r["benchmark"] and r["metric"], r["id"]
        assert (ROOT / r["raw"]).is_file(), f"microbench row {r['id']}: raw file {r['raw']} is missing"
        assert not r["superseded_by"] or r["superseded_by"] in ids, f"row {r['id']}: no row {r['superseded_by']}"
    for name, table in rt.MICRO_TABLES.items():
        assert any(r["benchmark"] == table.benchmark for r in rows), name


def test_microbench_store_is_what_its_raw_files_say() -> None:
    """Every microbenchmark number is read from its raw file by tools.microbench_import, never typed."""
    from tools import microbench_import

    assert microbench_import.main(["--check"]) == 0


def test_a_microbench_ratio_across_calls_is_refused() -> None:
    ours = micro(2, implementation="ours-triton", value="0.1")
    table = rt.MicroTable("kernels", ("eager", "ours-triton"), base={"implementation": "eager"}, ratio="speedup")
    assert "(2.00×)" in rt.render_micro(table, [micro(1), ours])
    with pytest.raises(rt.CrossCallRatio):
        rt.ratio(ours, micro(1, call="14"), "value")
    with pytest.raises(rt.CrossCallRatio):  # the base exists only in another call: refused, not skipped
        rt.render_micro(table, [micro(1, call="14"), ours])
    with pytest.raises(rt.CrossCallRatio):  # the same call name on another day is another call
        rt.render_micro(table, [micro(1, date="2026-11-26"), ours])


def test_append_rows_checks_microbench_rows(tmp_path: Path) -> None:
    store = tmp_path / "microbench.csv"
    assert append_rows([{"benchmark": "kernels", "value": 1.5}], store, columns=MICROBENCH_COLUMNS) == [1]
    assert read_rows(store)[0]["value"] == "1.5"
    with pytest.raises(ValueError):
        append_rows([{"benchmark": "kernels"}], store, columns=MICROBENCH_COLUMNS)  # no value
    with pytest.raises(ValueError):
        append_rows([{"parity": "pass", "value": 1}], store, columns=MICROBENCH_COLUMNS)


def test_a_number_without_a_passing_verdict_is_labelled() -> None:
    rows = {1: row(1), 2: row(2, parity="none"), 3: row(3, parity="pass", parity_file=""), 4: row(4, parity="fail")}
    text = rt.render(rt.Table([(i, None) for i in rows]), rows)
    lines = text.splitlines()[2:]
    assert "no verdict" not in lines[0] and "[pass]" in lines[0]
    for line in lines[1:]:
        assert "**no verdict**" in line and "[pass]" not in line


def test_a_superseded_row_is_labelled() -> None:
    rows = {1: row(1, superseded_by="2"), 2: row(2)}
    lines = rt.render(rt.Table([(1, None), (2, None)]), rows).splitlines()[2:]
    assert "superseded by #2" in lines[0] and "superseded" not in lines[1]


def test_simulated_rows_stay_out_of_throughput_tables() -> None:
    rows = {1: row(1), 2: row(2, simulated="1", mfu="0.9")}
    text = rt.render(rt.Table([(1, None), (2, 1)]), rows)
    assert "| 1 |" in text and "| 2 |" not in text
    assert "#2" not in rt.targets(rows)  # nor is a simulated row the best of anything


def test_simulated_table_marks_a_superseded_rank() -> None:
    rows = {1: row(1, simulated="1", raw="benchmarks/results/simulated/a/t.csv", superseded_by="2"),
            2: row(2, simulated="1", raw="benchmarks/results/simulated/b/t.csv")}
    lines = rt.simulated(rows).splitlines()
    assert "superseded by #2" in lines[2] and "superseded" not in lines[3]


def test_simulated_cuts_pair_rows_of_one_call_with_their_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cut's line holds its two rows' profile breakdowns from the call's table (found by tokens/s), and a pair
    from two calls is refused."""
    rows = rt.by_id(read_rows())
    line = rt.simulated_cuts(rows).splitlines()[3]  # the FSDP2 cut (call f2)
    assert "| 21.6 -> 32.5% | 1.51× | 52.0 -> 62.0% | 113.0 -> 94.9 ms |" in line
    monkeypatch.setattr(rt, "SIMULATED_CUTS", ((282, 300, "two calls"),))
    with pytest.raises(rt.CrossCallRatio):
        rt.simulated_cuts(rows)


def test_append_rows_assigns_ids_and_refuses_unknown_columns(tmp_path: Path) -> None:
    store = tmp_path / "runs.csv"
    assert append_rows([{"kind": "throughput", "parity": "pass"}, {"kind": "parity"}], store) == [1, 2]
    assert append_rows([{"kind": "throughput"}], store) == [3]
    assert [r["id"] for r in read_rows(store)] == ["1", "2", "3"]
    with pytest.raises(ValueError):
        append_rows([{"tokens": 1}], store)
    with pytest.raises(ValueError):
        append_rows([{"parity": "pending"}], store)


def test_readme_is_at_most_1200_words() -> None:
    assert len((ROOT / "README.md").read_text().split()) <= 1200


def test_train_sweep_appends_its_finished_runs(tmp_path: Path) -> None:
    from tools import train_sweep

    store = tmp_path / "runs.csv"
    args = train_sweep.parse_args(["--out", str(tmp_path / "sweep"), "--store", str(store), "--call", "Z"])
    sweep = train_sweep.Sweep(args)
    summary = {"mode": "hybrid", "model": "gpt2-tiny", "world_size": 2, "tp_size": 1, "batch_size_per_gpu": 4,
               "seq_len": 64, "compile": "off", "fused_kernels": "none", "zero3_fetch": "flat",
               "zero3_unit_blocks": 2, "tokens_per_s": 1234.5, "mfu": None, "device": "cpu"}
    sweep.results = [train_sweep.RunResult("hybrid", "none", 4, "fixed", "hybrid-none-b4", "ok", summary=summary),
                     train_sweep.RunResult("baseline", "none", 4, "fixed", "baseline-none-b4", "oom")]
    assert train_sweep.store_rows(sweep) == [1]
    (r,) = read_rows(store)
    assert (r["call"], r["engine"], r["zero3_fetch"], r["zero3_unit"], r["compile"], r["parity"]) == (
        "Z", "deepspeed", "flat", "2", "eager", "none")
    assert r["raw"].endswith("sweep/sweep.csv") and r["tokens_per_s"] == "1234.5"


def test_simulated_before_after_shows_each_layout_first_and_newest_with_profiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pair shows both rows' profile breakdowns (two calls, so no ratio); a layout measured once shows its row."""
    rows = rt.by_id(read_rows())
    monkeypatch.setattr(rt, "SIMULATED_BEFORE_AFTER", ((299, 300, "flat"), (None, 301, "")))
    _, _, pair, alone = rt.simulated_before_after(rows).splitlines()
    assert "| flat | #299 -> #300 | 21.6 -> 32.5% | 52.0 -> 62.0% | 113.0 -> 94.9 ms |" in pair
    assert "×" not in pair
    assert "| #301 | 10.3% | 30.6% |" in alone and "->" not in alone
    monkeypatch.setattr(rt, "SIMULATED_BEFORE_AFTER", ((304, 311, ""),))  # FSDP2 + TP2 at batch 8 and at 32
    with pytest.raises(ValueError, match="not one simulated layout"):
        rt.simulated_before_after(rows)


def test_kernel_sets_show_each_call_s_sets_with_their_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 55's table: none, triton, cuda of one call and batch, each against none (three decimals), with the
    profiled runs' device time by category read from their profile_breakdown.json; a group that is not one
    call's three sets at one batch is refused."""
    rows = rt.by_id(read_rows())
    monkeypatch.setattr(rt, "KERNEL_SETS", ((320, 321, 322), (337, 336, 335)))
    _, _, none, triton, cuda, unprofiled, *_ = rt.kernel_sets(rows).splitlines()
    assert "| 32 | 320 | none |" in none and "| 209.4 ms | 79.8 ms | 37.7 ms | 8.4 ms | 98.9% |" in none
    assert "1.004× #320" in triton and "| 5.9 ms |" in triton and "1.003× #320" in cuda
    assert unprofiled.endswith("|  |  |  |  |  |")
    monkeypatch.setattr(rt, "KERNEL_SETS", ((320, 336, 322),))  # triton of another call
    with pytest.raises(rt.CrossCallRatio):
        rt.kernel_sets(rows)
    monkeypatch.setattr(rt, "KERNEL_SETS", ((320, 322, 321),))  # cuda where triton belongs
    with pytest.raises(ValueError, match="not single --compile none, triton, cuda"):
        rt.kernel_sets(rows)
