"""NaN and infinite numbers are refused in every pipeline config, naming the option."""

import functools
import math
import types
import typing
from typing import Any, get_args, get_origin

import pytest
from pydantic import BaseModel

from flows import command
from flows.mlp import mlp
from flows.prepare import prepare
from flows.transformer import transformer
from trainflow.cli import pipeline_config
from trainflow.configs.mlp import MLPConfig
from trainflow.configs.transformer import TransformerConfig
from trainflow.data.config import load_preset

parse_sft = functools.partial(command.parse_args, "sft")


def _float_flags(model: type[BaseModel], defaults: BaseModel, prefix: str = "") -> list[str]:
    """Every float option of a config, as its command-line flag (nested models included)."""
    flags = []
    for name, info in type(defaults).model_fields.items():
        annotation = info.annotation
        if get_origin(annotation) in (typing.Union, types.UnionType):
            kinds = [a for a in get_args(annotation) if a is not type(None)]
            annotation = kinds[0] if len(kinds) == 1 else None
        value = getattr(defaults, name)
        dest = f"{prefix}{name}"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and value:
            flags += _float_flags(annotation, value, f"{dest}.")
        elif annotation is float:
            flags.append("--" + dest.replace(".", "-").replace("_", "-"))
    return flags


PIPELINES: dict[str, Any] = {
    "mlp": lambda argv: pipeline_config(mlp, MLPConfig(), argv, ""),
    "transformer": lambda argv: pipeline_config(transformer, TransformerConfig(), argv, ""),
    "sft": parse_sft,
    "prepare": lambda argv: pipeline_config(prepare, load_preset("instructions"), argv, ""),
}
DEFAULTS = {
    "mlp": MLPConfig(),
    "transformer": TransformerConfig(),
    "sft": parse_sft([]),
    "prepare": load_preset("instructions"),
}
CASES = [
    (pipeline, flag, bad)
    for pipeline, defaults in DEFAULTS.items()
    for flag in _float_flags(type(defaults), defaults)
    for bad in ("nan", "inf", "-inf")
]


def test_every_pipeline_has_float_options_to_check():
    assert {p for p, _, _ in CASES} == set(PIPELINES)
    assert len(CASES) >= 30


@pytest.mark.parametrize(("pipeline", "flag", "bad"), CASES)
def test_non_finite_number_is_refused_naming_the_option(pipeline, flag, bad, capsys):
    assert not math.isfinite(float(bad))
    with pytest.raises(SystemExit) as info:
        PIPELINES[pipeline]([f"{flag}={bad}"])
    assert info.value.code == 2
    assert f"{flag}: Input should be a finite number" in capsys.readouterr().err


def test_non_finite_number_inside_a_technique_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_sft(["--technique", '{"name": "ddp", "bucket_cap_mb": NaN}'])
    assert "--technique: ddp.bucket_cap_mb: Input should be a finite number" in (
        capsys.readouterr().err
    )
