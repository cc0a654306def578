"""The start-up check of the torch release (gpt2/runtime/torch_support.py): the range is pyproject.toml's, a torch
outside it is refused before any work with the fix named, and GPT2_ALLOW_UNSUPPORTED_TORCH=1 turns the refusal into
a warning."""

from __future__ import annotations

import re

import pytest
import torch

import train
from gpt2.config.schema import ConfigError
from gpt2.runtime.torch_support import ALLOW_ENV, check_torch_version, supported_torch


def test_range_is_pyprojects_and_holds_this_torch() -> None:
    assert str(supported_torch()) in {">=2.11,<2.14", "<2.14,>=2.11"}
    assert check_torch_version(torch.__version__) is None


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.0a0+79aa17489c", "2.13.0+cpu"])
def test_supported_builds_pass(version: str) -> None:
    assert check_torch_version(version) is None


@pytest.mark.parametrize("version", ["2.10.0+cu128", "2.14.0", "2.14.0.dev20261101", "1.13.1"])
def test_unsupported_torch_is_refused_naming_the_fix(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    expected = rf"torch {re.escape(version)} is outside the supported range.*pip install.*{ALLOW_ENV}=1"
    with pytest.raises(ConfigError, match=expected):
        check_torch_version(version)
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert "running anyway" in check_torch_version(version)


def test_train_refuses_before_any_work(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                       tmp_path) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    out = tmp_path / "runs"
    assert train.main(["--mode", "single", "--model", "gpt2-tiny", "--data", "synthetic", "--out-dir", str(out)]) == 2
    assert "torch 2.10.0 is outside the supported range" in capsys.readouterr().err
    assert not out.exists()  # refused before a run folder
