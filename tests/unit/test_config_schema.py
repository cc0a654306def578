"""The config schema is the one place for each flag's default and help: the parser is built from its fields, and
what the parser leaves out of argv is what the dataclasses say."""

from __future__ import annotations

import dataclasses

import pytest

from gpt2.config.cli import SECTIONS, build_parser, parse_args
from gpt2.config.schema import MODEL_PRESETS, RunConfig, flag_of


def _flagged_fields() -> list[tuple[str, dataclasses.Field]]:
    return [(section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls) if flag_of(f)]


def test_every_flag_comes_from_one_field_and_has_help() -> None:
    parser = build_parser()
    dests = [a.dest for a in parser._actions]
    fields = _flagged_fields()
    assert len({f.name for _, f in fields}) == len(fields), "two sections flag a field of the same name"
    for _, f in fields:
        assert dests.count(f.name) == 1, f.name
        assert flag_of(f).help.strip(), f"{f.name} has no help"
    # the flags that are no field: the alias, the launcher's --local_rank and -h
    assert sorted(set(dests) - {f.name for _, f in fields}) == ["help", "local_rank", "use_fused_kernel"]


def test_no_flags_give_the_dataclass_defaults() -> None:
    """A field's default is written once: argv without flags parses to the dataclasses' own defaults (the model
    shape from its --model preset, the compile scope and the optimizer that `auto` resolves to for single)."""
    cfg = parse_args([])
    defaults = RunConfig(train=SECTIONS["train"](), model=SECTIONS["model"](**MODEL_PRESETS["gpt2-tiny"]),
                         data=SECTIONS["data"](), parallel=SECTIONS["parallel"](), log=SECTIONS["log"]())
    resolved = {"compile_scope": "model", "optimizer": "torch"}
    assert cfg.to_dict() == {**defaults.to_dict(), "train": {**defaults.to_dict()["train"], **resolved}}


@pytest.mark.parametrize("section, name", [(s, f.name) for s, f in _flagged_fields() if flag_of(f).given_only])
def test_given_only_flags_fall_back_to_the_field_default(section: str, name: str) -> None:
    """A flag whose parser default is None (a rule needs to know it was left out) still gets its field's default,
    and its --help says what applies."""
    parser_default = {a.dest: a for a in build_parser()._actions}[name]
    assert parser_default.default is None and "(default: " in parser_default.help
    field = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]
    if section != "model" and name not in ("compile_scope", "throughput_warmup_steps"):  # preset / derived
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        assert getattr(getattr(parse_args(["--mode", "hybrid"]), section), name) == default
