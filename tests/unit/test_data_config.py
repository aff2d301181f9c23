"""DataConfig validation: bad input fails before any work, naming the field or file."""

import filecmp

import pytest
from pydantic import ValidationError

from tests.unit.conftest_data import REPO_ROOT, TOKENIZER, chat_config, tabular_config
from trainflow.data import DataConfig, load_preset


def _raw(tmp_path, **overrides):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "hello"}\n')
    raw = {
        "name": "rows",
        "source": {"kind": "files", "files": {"train": [str(path)]}},
        "transform": {"name": "text", "tokenizer": TOKENIZER},
    }
    raw.update(overrides)
    return raw


def test_unknown_transform_is_rejected_naming_the_field(tmp_path):
    with pytest.raises(ValidationError) as err:
        DataConfig.model_validate(_raw(tmp_path, transform={"name": "summarize"}))
    message = str(err.value)
    assert "transform" in message and "'summarize'" in message
    assert "'text', 'chat', 'tabular'" in message


def test_missing_source_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    source = {"kind": "files", "files": {"train": [str(missing)]}}
    with pytest.raises(ValidationError, match=r"files\['train'\]: file not found: .*nope\.jsonl"):
        DataConfig.model_validate(_raw(tmp_path, source=source))


def test_unknown_file_extension_needs_a_format(tmp_path):
    odd = tmp_path / "rows.txt"
    odd.write_text("x\n")
    source = {"kind": "files", "files": {"train": [str(odd)]}}
    with pytest.raises(ValidationError, match=r"format: cannot infer .*'\.txt'"):
        DataConfig.model_validate(_raw(tmp_path, source=source))


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("compression", "lz9", "compression 'lz9' is not one streaming supports"),
        ("shard_size", "huge", "shard_size 'huge' is not a size"),
        ("hashes", ["md7"], r"hashes: unknown algorithm\(s\) \['md7'\]"),
        ("name", "../escape", "name '../escape'"),
        ("splits", ["test"], r"splits: split\(s\) \['test'\] not in source files \['train'\]"),
        ("num_proc", 0, "num_proc"),
    ],
)
def test_bad_write_options_are_rejected_naming_the_field(tmp_path, field, value, pattern):
    with pytest.raises(ValidationError, match=pattern):
        DataConfig.model_validate(_raw(tmp_path, **{field: value}))


def test_validation_split_must_come_from_a_kept_split(tmp_path):
    with pytest.raises(ValidationError, match="validation.from_split: split 'dev'"):
        DataConfig.model_validate(_raw(tmp_path, validation={"from_split": "dev", "fraction": 0.1}))
    with pytest.raises(ValidationError, match="validation.name: split 'train' already exists"):
        DataConfig.model_validate(_raw(tmp_path, validation={"fraction": 0.1, "name": "train"}))


def test_tabular_id_column_name_is_reserved(tmp_path):
    with pytest.raises(
        ValidationError, match="'id' is reserved; name the source column in id_column"
    ):
        tabular_config(tmp_path, transform={"name": "tabular", "columns": {"id": "int64"}})


def test_extra_fields_are_forbidden(tmp_path):
    with pytest.raises(ValidationError, match="shard_sise"):
        DataConfig.model_validate(_raw(tmp_path, shard_sise="1mb"))


def test_presets_point_at_shipped_files():
    instructions = load_preset("instructions")
    assert instructions.transform.name == "chat"
    assert instructions.source.files["train"] == [str(REPO_ROOT / "data" / "instructions.jsonl")]
    assert instructions.transform.tokenizer == TOKENIZER
    interactions = load_preset("interactions")
    assert interactions.transform.name == "tabular"
    assert interactions.source.format == "csv"
    with pytest.raises(ValueError, match=r"unknown data preset 'nope'.*'instructions'"):
        load_preset("nope")


def test_shipped_data_is_what_the_generator_makes(tmp_path):
    """data/ must be reproducible from scripts/make_data.py (no hand edits, no drift)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_data", REPO_ROOT / "scripts" / "make_data.py"
    )
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    make_data.generate(tmp_path)
    for name in [
        "instructions.jsonl",
        "interactions.csv",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "tokenizer/chat_template.jinja",
    ]:
        assert filecmp.cmp(REPO_ROOT / "data" / name, tmp_path / name, shallow=False), name


def test_chat_config_helper_round_trips_through_json(tmp_path):
    config = chat_config(tmp_path)
    assert DataConfig.model_validate_json(config.model_dump_json()) == config
