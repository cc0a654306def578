"""gpt2.train.export refuses to overwrite: an existing non-empty output folder is an error before any loading."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpt2.train.export as export


def _no_loading(step_dir: Path) -> None:
    raise AssertionError(f"the checkpoint {step_dir} was loaded before the output folder was checked")


def test_export_refuses_non_empty_out_dir_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(export, "consolidated_state_dict", _no_loading)
    out = tmp_path / "exported"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')

    assert export.main([str(tmp_path / "ck"), str(out)]) == 2

    err = capsys.readouterr().err
    assert str(out) in err and "new or empty folder" in err
    assert (out / "config.json").read_text() == '{"mine": true}'  # the user's file is untouched
    assert [p.name for p in out.iterdir()] == ["config.json"]


def test_export_refuses_a_file_as_out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(export, "consolidated_state_dict", _no_loading)
    out = tmp_path / "exported"
    out.write_text("notes")
    assert export.main([str(tmp_path / "ck"), str(out)]) == 2
    assert out.read_text() == "notes"


def test_export_accepts_new_or_empty_out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the check passes, so the export goes on to load the checkpoint (stubbed here to stop there)
    class Loaded(Exception):
        pass

    def stop(step_dir: Path) -> None:
        raise Loaded

    monkeypatch.setattr(export, "consolidated_state_dict", stop)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        with pytest.raises(Loaded):
            export.export_hf(tmp_path / "ck", out)
