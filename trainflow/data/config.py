"""Typed configuration for data preparation and reading, and the small result it returns.

A `DataConfig` says where the rows come from (`source`), which splits to keep or carve out,
how rows become training columns (`transform`, chosen by name) and how the MDS shards are
written. Validators reject bad input before any file is read.
"""

import re
import unicodedata
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESETS_DIR = Path(__file__).with_name("presets")

FORMATS_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

# Write options that streaming's own checks accept (a test holds them to that). Only other
# values import streaming to be checked: importing it imports torch, and flow modules validate
# their default configs at import time, which must stay fast.
KNOWN_COMPRESSIONS = frozenset({"zstd"})
KNOWN_SHARD_SIZES = frozenset({"1mb", "32mb"})
KNOWN_HASHES = frozenset({"sha1"})

ScalarType = Literal[
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "str",
]


# A dataset name is one path component: letters and digits of any script, '.', '_', '-'.
MAX_NAME_BYTES = 128
_NAME_CHAR = re.compile(r"[\w.-]")


def _name_char(c: str) -> bool:
    return bool(_NAME_CHAR.match(c) or unicodedata.combining(c))


def _name_problem(name: str) -> str | None:
    if not name or not name[0].isalnum():
        return "it must start with a letter or digit"
    bad = sorted({c for c in name if not _name_char(c)})
    if bad:
        return f"it has {''.join(bad)!r}; use letters, digits, '.', '_' or '-'"
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"it is {len(name.encode())} bytes in UTF-8, more than {MAX_NAME_BYTES}"
    return None


def name_for_file(path: str | Path) -> str:
    """A dataset name for the file at `path`: its name less the extension, with each run of
    characters a name cannot hold (spaces, brackets, ...) turned into '-', and cut to fit.

    Letters of any script are kept (`données-训练.jsonl` -> `données-训练`).
    """
    stem = unicodedata.normalize("NFC", Path(path).stem)
    kept = "".join(c if _name_char(c) else " " for c in stem)
    name = re.sub(r" +", "-", kept.strip())
    while name and not name[0].isalnum():
        name = name[1:]
    while len(name.encode()) > MAX_NAME_BYTES:
        name = name[:-1]
    return name or "data"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class FileSource(_Model):
    """Local JSONL, CSV or Parquet files, grouped by split."""

    kind: Literal["files"] = Field("files", description="Source kind: local files.")
    files: dict[str, list[str]] = Field(
        description="Split name -> list of files for that split, e.g. {'train': ['a.jsonl']}. "
        "Relative paths are resolved against the current directory."
    )
    format: Literal["json", "csv", "parquet"] | None = Field(
        None, description="File format; inferred from the extension (.jsonl/.json/.csv/.parquet)."
    )

    @field_validator("files")
    @classmethod
    def _files_exist(cls, files: dict[str, list[str]]) -> dict[str, list[str]]:
        if not files:
            raise ValueError("files: give at least one split with at least one file")
        for split, paths in files.items():
            if not paths:
                raise ValueError(f"files[{split!r}]: split {split!r} lists no files")
            for path in paths:
                if not Path(path).is_file():
                    raise ValueError(f"files[{split!r}]: file not found: {path}")
        return {split: [str(Path(p).resolve()) for p in paths] for split, paths in files.items()}

    @model_validator(mode="after")
    def _known_format(self) -> "FileSource":
        if self.format is None:
            suffixes = {Path(p).suffix.lower() for paths in self.files.values() for p in paths}
            formats = {FORMATS_BY_SUFFIX.get(s) for s in suffixes}
            if None in formats or len(formats) != 1:
                raise ValueError(
                    f"format: cannot infer one format from file extensions {sorted(suffixes)}; "
                    f"use {sorted(FORMATS_BY_SUFFIX)} or set format"
                )
            object.__setattr__(self, "format", formats.pop())
        return self


class HubSource(_Model):
    """A dataset on the Hugging Face Hub (needs network)."""

    kind: Literal["hub"] = Field("hub", description="Source kind: a Hugging Face Hub dataset.")
    name: str = Field(description="Hub dataset id, e.g. 'HuggingFaceH4/no_robots'.")
    subset: str | None = Field(None, description="Dataset configuration (subset) name, if any.")
    revision: str | None = Field(
        None, description="Branch, tag or commit; resolved to a commit hash for the cache key."
    )


Source = Annotated[FileSource | HubSource, Field(discriminator="kind")]


class ValidationSplit(_Model):
    """Carve a validation split out of another split, reproducibly."""

    from_split: str = Field("train", description="Split to take the validation rows from.")
    fraction: float = Field(gt=0.0, lt=1.0, description="Fraction of rows moved to validation.")
    seed: int = Field(0, description="Seed of the random train/validation assignment.")
    name: str = Field("validation", description="Name of the new split.")
    order_column: str | None = Field(
        None,
        description="Split by this column's order instead of at random: the rows with the "
        "highest values move (a split by time, e.g. an event time or sequence number), so the "
        "new split never holds rows older than the ones left behind.",
    )


class _TokenTransform(_Model):
    tokenizer: str = Field(
        description="Tokenizer: a local directory (e.g. 'data/tokenizer') or a Hub model id "
        "(e.g. 'meta-llama/Llama-3.2-1B-Instruct')."
    )
    max_length: int | None = Field(
        None, ge=2, description="Longest sequence in tokens; None keeps every row whole."
    )
    keep_columns: dict[str, ScalarType] = Field(
        default_factory=dict,
        description="Source columns carried into the shards unchanged, with their MDS type.",
    )


class TextTransform(_TokenTransform):
    """Plain text -> `input_ids` (language modelling)."""

    name: Literal["text"] = Field("text", description="Transform name.")
    text_column: str = Field("text", description="Column holding the text.")
    add_eos: bool = Field(True, description="Append the tokenizer's EOS token to each row.")
    overflow: Literal["truncate", "drop"] = Field(
        "truncate", description="What to do with rows longer than max_length."
    )


class ChatTransform(_TokenTransform):
    """Chat/instruction records -> `input_ids` + `assistant_masks` via the chat template."""

    name: Literal["chat"] = Field("chat", description="Transform name.")
    messages_column: str = Field(
        "messages", description="Column holding a list of {'role', 'content'} messages."
    )
    overflow: Literal["truncate", "drop"] = Field(
        "drop",
        description="What to do with rows longer than max_length (drop keeps every answer whole).",
    )
    turns: bool = Field(
        False,
        description="Also write `turns` (json): per answer, the tokens since the previous answer "
        "and the answer's tokens, [{'input_ids': [...], 'labels': [...]}, ...]; the layout LLM "
        "Foundry's finetuning loader reads.",
    )


class TabularTransform(_Model):
    """Tabular records -> typed scalar columns."""

    name: Literal["tabular"] = Field("tabular", description="Transform name.")
    columns: dict[str, ScalarType] = Field(
        description="Columns to keep, each with its MDS type, e.g. {'user_id': 'int64'}."
    )

    @field_validator("columns")
    @classmethod
    def _some_columns(cls, columns: dict[str, ScalarType]) -> dict[str, ScalarType]:
        if not columns:
            raise ValueError("columns: name at least one column and its type")
        return columns


class DetectionTransform(_Model):
    """Images with boxes -> `image` (PNG bytes), `boxes` and `labels` for object detection.

    Boxes are written flat (`x1, y1, x2, y2` per object, float32 pixels) beside one int64 label
    per object; every box must lie inside its image and every label in `0..num_classes-1`.
    """

    name: Literal["detection"] = Field("detection", description="Transform name.")
    num_classes: int = Field(ge=1, description="Object classes; labels are 0..num_classes-1.")
    image_column: str = Field("image", description="Column holding encoded image bytes (PNG).")
    boxes_column: str = Field(
        "boxes", description="Column holding a list of [x1, y1, x2, y2] pixel boxes per image."
    )
    labels_column: str = Field(
        "labels", description="Column holding one integer class label per box."
    )


Transform = Annotated[
    TextTransform | ChatTransform | TabularTransform | DetectionTransform,
    Field(discriminator="name"),
]


class DataConfig(_Model):
    """Everything that decides the content of a prepared dataset (and where it is published)."""

    name: str = Field(description="Dataset name; the output directory is '<name>-<hash>'.")
    source: Source = Field(description="Where the rows come from.")
    splits: list[str] | None = Field(
        None, description="Source splits to keep (None keeps all of them)."
    )
    validation: ValidationSplit | None = Field(
        None, description="Optionally carve a validation split out of another split."
    )
    id_column: str | None = Field(
        None,
        description="Integer column with a unique id per row; None numbers rows 0..n-1 per split. "
        "Written as the 'id' column.",
    )
    transform: Transform = Field(
        description="How rows become columns: 'text', 'chat', 'tabular', 'detection'."
    )
    compression: str | None = Field(
        "zstd", description="MDS shard compression, e.g. 'zstd', 'zstd:7', 'gz'; None for none."
    )
    shard_size: str = Field("32mb", description="Largest shard before compression, e.g. '32mb'.")
    hashes: list[str] = Field(
        default_factory=lambda: ["sha1"],
        description="Hashes stored per shard and checked on read (streaming's validate_hash).",
    )
    output_root: str | None = Field(
        None,
        description="Local directory or 's3://bucket/prefix' to publish under; "
        "None means $TRAINFLOW_DATASETS, else $TRAINFLOW_HOME/datasets.",
    )
    num_proc: int | None = Field(
        None,
        ge=1,
        description="Processes that tokenize and write each split (1: this process only; "
        "None: one per available core, each with at least 4000 rows). The shards' samples and "
        "their order do not depend on it.",
    )
    test: ValidationSplit | None = Field(
        None,
        description="Optionally carve a test split as well (give it its name, e.g. 'test'); "
        "carved before `validation`, so with `order_column` it holds the latest rows.",
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        name = unicodedata.normalize("NFC", name)
        problem = _name_problem(name)
        if problem is not None:
            raise ValueError(f"name {name!r} cannot name a dataset folder: {problem}")
        return name

    @field_validator("compression")
    @classmethod
    def _known_compression(cls, compression: str | None) -> str | None:
        if compression is None or compression in KNOWN_COMPRESSIONS:
            return compression
        from streaming.base.compression import is_compression

        if not is_compression(compression):
            raise ValueError(f"compression {compression!r} is not one streaming supports")
        return compression

    @field_validator("shard_size")
    @classmethod
    def _parse_shard_size(cls, shard_size: str) -> str:
        if shard_size in KNOWN_SHARD_SIZES:
            return shard_size
        from streaming.base.util import bytes_to_int

        try:
            size = bytes_to_int(shard_size)
        except ValueError as err:
            raise ValueError(f"shard_size {shard_size!r} is not a size like '32mb'") from err
        if not 0 < size < 2**32:
            raise ValueError(f"shard_size {shard_size!r} must be between 1 byte and 4gb")
        return shard_size

    @field_validator("hashes")
    @classmethod
    def _known_hashes(cls, hashes: list[str]) -> list[str]:
        if not KNOWN_HASHES.issuperset(hashes):
            from streaming.base.hashing import get_hashes

            unknown = sorted(set(hashes) - get_hashes())
            if unknown:
                raise ValueError(f"hashes: unknown algorithm(s) {unknown}")
        return sorted(set(hashes))

    @model_validator(mode="after")
    def _consistent_splits(self) -> "DataConfig":
        known = set(self.source.files) if isinstance(self.source, FileSource) else None
        if self.splits is not None:
            if not self.splits or len(set(self.splits)) != len(self.splits):
                raise ValueError(f"splits: give distinct split names, got {self.splits}")
            if known is not None and set(self.splits) - known:
                missing = sorted(set(self.splits) - known)
                raise ValueError(f"splits: split(s) {missing} not in source files {sorted(known)}")
        if self.validation is not None:
            kept = self.splits if self.splits is not None else known
            if kept is not None and self.validation.from_split not in kept:
                raise ValueError(
                    f"validation.from_split: split {self.validation.from_split!r} "
                    f"is not among the splits {sorted(kept)}"
                )
            if kept is not None and self.validation.name in kept:
                raise ValueError(
                    f"validation.name: split {self.validation.name!r} already exists in the source"
                )
        if self.test is not None:
            if self.validation is not None and self.test.name == self.validation.name:
                raise ValueError(f"test.name: {self.test.name!r} is the validation split's name")
            kept = self.splits if self.splits is not None else known
            if kept is not None and self.test.from_split not in kept:
                raise ValueError(
                    f"test.from_split: split {self.test.from_split!r} "
                    f"is not among the splits {sorted(kept)}"
                )
            if kept is not None and self.test.name in kept:
                raise ValueError(
                    f"test.name: split {self.test.name!r} already exists in the source"
                )
        if isinstance(self.transform, TabularTransform) and "id" in self.transform.columns:
            raise ValueError(
                "transform.columns: 'id' is reserved; name the source column in id_column"
            )
        return self


class LoaderConfig(_Model):
    """How each rank reads a prepared split."""

    batch_size: int = Field(ge=1, description="Samples per batch on each rank.")
    shuffle: bool = Field(True, description="Shuffle samples each epoch (deterministic in seed).")
    seed: int = Field(0, description="Shuffle seed; the same seed gives the same order.")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank.")
    prefetch: int = Field(
        2,
        ge=0,
        description="Batches a background thread reads ahead while the rank trains (0: read "
        "each batch when the loop asks for it). Worker processes (num_workers) read ahead "
        "themselves instead.",
    )
    drop_last: bool = Field(False, description="Drop each rank's last incomplete batch.")
    num_canonical_nodes: int | None = Field(
        None,
        ge=1,
        description="streaming's canonical node count; fix it to keep the sample order when "
        "the number of nodes changes (None: the number of nodes at the start).",
    )
    validate_hash: bool = Field(True, description="Check each shard's hash as it is fetched.")
    clean_stale_shared_memory: bool = Field(
        True,
        description="Before reading, remove streaming's shared memory and lock files that no "
        "live process uses (left by crashed runs).",
    )


class SplitInfo(_Model):
    """What was written for one split."""

    num_samples: int = Field(description="Rows written.")
    num_dropped: int = Field(0, description="Rows dropped for exceeding max_length.")
    num_bytes: int = Field(description="Bytes of the split's shards and index on disk.")


class PreparedDataset(_Model):
    """A published dataset: what later tasks need to read it."""

    uri: str = Field(description="Published dataset directory (local path or s3:// URI).")
    name: str = Field(description="Dataset name.")
    fingerprint: str = Field(description="Content hash of source, transform and write options.")
    splits: dict[str, SplitInfo] = Field(description="Per-split sample counts and sizes.")
    columns: dict[str, str] = Field(description="Column name -> MDS type.")
    num_bytes: int = Field(description="Total bytes of all splits.")
    cache_hit: bool = Field(False, description="True when an earlier run had already published it.")


def preset_names() -> list[str]:
    """Names of the shipped data presets under `trainflow/data/presets/`."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_preset(name: str) -> DataConfig:
    """Load a shipped preset (YAML under `trainflow/data/presets/`) into a `DataConfig`.

    Relative file and tokenizer paths in presets are resolved against the repository root, so
    presets work from any working directory of a checkout.

    Args:
        name: Preset name, e.g. 'instructions' or 'interactions'.

    Returns:
        The validated config.
    """
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
        raise ValueError(f"unknown data preset {name!r}; known presets: {known}")
    raw = yaml.safe_load(path.read_text())
    source = raw.get("source", {})
    if source.get("kind") == "files":
        source["files"] = {
            split: [str(REPO_ROOT / p) for p in paths] for split, paths in source["files"].items()
        }
    transform = raw.get("transform", {})
    tokenizer = transform.get("tokenizer")
    if tokenizer and (REPO_ROOT / tokenizer).exists():
        transform["tokenizer"] = str(REPO_ROOT / tokenizer)
    return DataConfig.model_validate(raw)
