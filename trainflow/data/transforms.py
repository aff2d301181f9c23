"""Transforms, chosen by name: rows of a split -> the typed columns written to MDS.

Every transform also writes an integer `id` column (from `DataConfig.id_column`, else the row
number in the split) so readers can check exactly which samples they saw.

- `text`: `input_ids` (TRL's pre-tokenized language-modelling format).
- `chat`: `input_ids` + `assistant_masks` (1 on answer tokens, including the end-of-turn token),
  the columns TRL 1.16's `SFTTrainer` folds into labels for pre-tokenized data; with
  `turns: true` also `turns`, the same tokens cut into (prompt, answer) pairs (`chat_turns`).
- `tabular`: the named columns, cast to their declared types.
- `detection`: `image` (PNG bytes), `boxes` (flat float32 `x1, y1, x2, y2` per object) and
  `labels` (int64, one per object), each box checked against its image's size.
"""

import os
import re
import threading
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from trainflow.data.config import (
    ChatTransform,
    DataConfig,
    DetectionTransform,
    ScalarType,
    TabularTransform,
    TextTransform,
)
from trainflow.data.errors import DataError
from trainflow.data.sources import describe_split

_ARROW_TYPES = {"str": "string"}
# Fewest rows that pay for one more conversion process (measured: about 1 s of start-up).
MIN_ROWS_PER_PROCESS = 4000
# How transformers finds answer markers in a chat template (`{% generation %}` blocks).
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
DETECTION_COLUMNS = {"image": "bytes", "boxes": "ndarray:float32", "labels": "ndarray:int64"}


def num_processes(config: DataConfig, num_rows: int) -> int | None:
    """Processes that convert and write `num_rows` rows: None means this process alone.

    `config.num_proc` when set; otherwise one per core this process may use, but only as many
    as have `MIN_ROWS_PER_PROCESS` rows each, since a process costs its start and a copy of the
    tokenizer. The shards' content never depends on it.
    """
    if config.num_proc is not None:
        wanted = config.num_proc
    else:
        wanted = min(len(os.sched_getaffinity(0)), num_rows // MIN_ROWS_PER_PROCESS)
    return wanted if wanted > 1 else None


def output_columns(config: DataConfig) -> dict[str, str]:
    """MDS column name -> MDS type for what `config` writes."""
    transform = config.transform
    columns: dict[str, str] = {"id": "int64"}
    if isinstance(transform, TabularTransform):
        columns.update(transform.columns)
        return columns
    if isinstance(transform, DetectionTransform):
        columns.update(DETECTION_COLUMNS)
        return columns
    columns["input_ids"] = "ndarray:int32"
    if isinstance(transform, ChatTransform):
        columns["assistant_masks"] = "ndarray:uint8"
        if transform.turns:
            columns["turns"] = "json"
    columns.update(transform.keep_columns)
    return columns


def _require_column(config: DataConfig, split: str, ds: datasets.Dataset, column: str) -> None:
    if column not in ds.column_names:
        raise DataError(
            f"column {column!r} missing from {describe_split(config, split)}; "
            f"it has columns {ds.column_names}"
        )


def _cast_scalars(
    config: DataConfig, split: str, ds: datasets.Dataset, types: dict[str, ScalarType]
) -> datasets.Dataset:
    """Cast each named column to its declared type; reject missing columns, nulls, bad values."""
    for column, dtype in types.items():
        _require_column(config, split, ds, column)
        if ds.data.column(column).null_count:
            raise DataError(
                f"column {column!r} of {describe_split(config, split)} has "
                f"{ds.data.column(column).null_count} empty value(s); {dtype} needs a value per row"
            )
        feature = ds.features[column]
        if not isinstance(feature, datasets.Value):
            raise DataError(
                f"column {column!r} of {describe_split(config, split)} holds {feature}, "
                f"not a scalar that can be typed as {dtype}"
            )
        if (dtype == "str") != (feature.dtype in ("string", "large_string")):
            raise DataError(
                f"column {column!r} of {describe_split(config, split)} has type "
                f"{feature.dtype}, which cannot be written as {dtype}"
            )
        try:
            ds = ds.cast_column(column, datasets.Value(_ARROW_TYPES.get(dtype, dtype)))
        except Exception as err:  # pyarrow refuses lossy or impossible casts
            raise DataError(
                f"column {column!r} of {describe_split(config, split)} cannot be cast from "
                f"{feature.dtype} to {dtype}: {err}"
            ) from err
    return ds


def _with_ids(config: DataConfig, split: str, ds: datasets.Dataset) -> datasets.Dataset:
    if config.id_column is None:
        if "id" in ds.column_names:
            ds = ds.remove_columns("id")
        return ds.add_column("id", np.arange(len(ds), dtype=np.int64))
    ds = _cast_scalars(config, split, ds, {config.id_column: "int64"})
    ids = ds.data.column(config.id_column).to_numpy()
    if len(np.unique(ids)) != len(ids):
        raise DataError(
            f"column {config.id_column!r} (id_column) of {describe_split(config, split)} "
            "has duplicate values; ids must be unique per split"
        )
    if config.id_column != "id":
        if "id" in ds.column_names:
            ds = ds.remove_columns("id")
        ds = ds.rename_column(config.id_column, "id")
    return ds


# transformers compiles each chat template once per process (a cached jinja environment shared
# by every tokenizer with that template) and tracks `{% generation %}` blocks on that shared
# environment: two threads rendering with the assistant mask at once fail with "AssistantTracker
# should not be reused before closed". Two pipelines in one process (a sweep's parallel trials)
# tokenize at once, so marked renders take turns. `datasets`' worker processes have their own.
_MARKED_RENDER = threading.Lock()


class _ChatTokenizer:
    """Batched map function: messages -> input_ids + assistant_masks (picklable for num_proc).

    A chat template that marks answers with `{% generation %}` renders each conversation once:
    `apply_chat_template(..., return_assistant_tokens_mask=True)` gives the ids and the mask of
    the marked tokens. Any other template renders every assistant turn's prefix as well, and a
    token counts as answer when it starts inside an assistant turn's span. Both rules give the
    same mask for the shipped tokenizer (a test holds them to that).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, column: str, split: str) -> None:
        self.tokenizer = tokenizer
        self.column = column
        self.split = split
        template = tokenizer.chat_template
        self.marked = isinstance(template, str) and bool(_GENERATION_BLOCK.search(template))

    def _where(self, row_id: int) -> str:
        return f"row id {row_id} of split {self.split!r} (column {self.column!r})"

    def _render(self, messages: list[dict[str, str]], prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt
        )
        assert isinstance(text, str)
        return text

    def _spans(self, row_id: int, messages: list[dict[str, str]]) -> tuple[str, list[range]]:
        """The rendered conversation and the character span of each assistant turn."""
        where = self._where(row_id)
        try:
            text = self._render(messages, prompt=False)
            spans = []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = self._render(messages[:i], prompt=True)
                last = i == len(messages) - 1
                through = text if last else self._render(messages[: i + 1], prompt=False)
                if not (text.startswith(before) and text.startswith(through)):
                    raise DataError(
                        f"{where}: the chat template does not render turns as prefixes of the "
                        "conversation, so the answer mask cannot be computed"
                    )
                spans.append(range(len(before), len(through)))
        except DataError:
            raise
        except Exception as err:  # template errors (unknown role, bad content type...)
            raise DataError(f"{where}: chat template failed: {err}") from err
        if not spans:
            raise DataError(f"{where}: no assistant message, so nothing to learn")
        return text, spans

    def _marked(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """One render per conversation; the template's generation blocks are the answers."""
        conversations = batch[self.column]
        for row_id, messages in zip(batch["id"], conversations, strict=True):
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError(f"{self._where(row_id)}: no assistant message, so nothing to learn")
        try:
            with _MARKED_RENDER:
                encoded: Any = self.tokenizer.apply_chat_template(
                    conversations,
                    tokenize=True,
                    return_dict=True,
                    return_assistant_tokens_mask=True,
                )
        except Exception:  # template errors: render row by row to name the row
            for row_id, messages in zip(batch["id"], conversations, strict=True):
                try:
                    self._render(messages, prompt=False)
                except Exception as err:
                    raise DataError(f"{self._where(row_id)}: chat template failed: {err}") from err
            raise
        return {"input_ids": encoded["input_ids"], "assistant_masks": encoded["assistant_masks"]}

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self.marked:
            return self._marked(batch)
        rendered = [self._spans(i, m) for i, m in zip(batch["id"], batch[self.column], strict=True)]
        encoded = self.tokenizer(
            [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True
        )
        masks = []
        for (_, spans), offsets in zip(rendered, encoded["offset_mapping"], strict=True):
            masks.append([int(any(start in span for span in spans)) for start, _ in offsets])
        return {"input_ids": encoded["input_ids"], "assistant_masks": masks}


class _TextTokenizer:
    """Batched map function: text -> input_ids (+ EOS)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, column: str, add_eos: bool) -> None:
        self.tokenizer = tokenizer
        self.column = column
        self.add_eos = add_eos

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        ids = self.tokenizer(batch[self.column])["input_ids"]
        if self.add_eos:
            ids = [row + [self.tokenizer.eos_token_id] for row in ids]
        return {"input_ids": ids}


def chat_turns(input_ids: list[int], mask: list[int]) -> list[dict[str, list[int]]]:
    """A conversation's tokens cut at its answers: per answer, the tokens since the previous
    one (`input_ids`) and the answer (`labels`). Joined in order they give the conversation
    back, up to its last answer; nothing follows an answer that ends the conversation.
    """
    turns: list[dict[str, list[int]]] = []
    start = 0
    i = 0
    while i < len(input_ids):
        if mask[i]:
            end = i
            while end < len(input_ids) and mask[end]:
                end += 1
            turns.append({"input_ids": input_ids[start:i], "labels": input_ids[i:end]})
            start = i = end
        else:
            i += 1
    return turns


def _fit_length(
    transform: TextTransform | ChatTransform, ds: datasets.Dataset, num_proc: int | None
) -> datasets.Dataset:
    """Apply max_length: truncate or drop long rows; drop rows left with no answer tokens."""
    limit = transform.max_length
    if limit is None:
        return ds
    if transform.overflow == "drop":
        return ds.filter(
            lambda ids: len(ids) <= limit, input_columns="input_ids", num_proc=num_proc
        )

    columns = ["input_ids"] + (["assistant_masks"] if isinstance(transform, ChatTransform) else [])
    ds = ds.map(
        lambda batch: {k: [row[:limit] for row in batch[k]] for k in columns},
        batched=True,
        num_proc=num_proc,
    )
    if isinstance(transform, ChatTransform):
        ds = ds.filter(lambda m: 1 in m, input_columns="assistant_masks", num_proc=num_proc)
    return ds


class _DetectionRows:
    """Batched map function: image bytes + nested boxes + labels -> the checked MDS columns."""

    def __init__(self, transform: DetectionTransform, where: str) -> None:
        self.transform = transform
        self.where = where

    def _row(self, row_id: int, image: bytes, boxes: Any, labels: Any) -> tuple[Any, Any]:
        from trainflow.data.shapes import decode_png

        t = self.transform
        where = f"row id {row_id} of {self.where}"
        try:
            height, width = decode_png(image).shape[:2]
        except Exception as err:  # PIL raises several types for bytes that are no image
            raise DataError(f"{where}: column {t.image_column!r} is not an image: {err}") from err
        box_array = np.asarray(boxes, dtype=np.float32).reshape(-1, 4) if boxes else None
        label_array = np.asarray(labels if labels is not None else [], dtype=np.int64)
        if box_array is None or len(box_array) != len(label_array):
            raise DataError(
                f"{where}: {len(label_array)} label(s) in {t.labels_column!r} for "
                f"{0 if box_array is None else len(box_array)} box(es) in {t.boxes_column!r}; "
                "give at least one box and one label per box"
            )
        x1, y1, x2, y2 = box_array.T
        if not (
            (x1 >= 0) & (x1 < x2) & (x2 <= width) & (y1 >= 0) & (y1 < y2) & (y2 <= height)
        ).all():
            raise DataError(
                f"{where}: column {t.boxes_column!r} has a box that is empty or outside the "
                f"{width} x {height} image: {box_array.tolist()}"
            )
        if not ((label_array >= 0) & (label_array < t.num_classes)).all():
            raise DataError(
                f"{where}: column {t.labels_column!r} has labels {label_array.tolist()} outside "
                f"0..{t.num_classes - 1} (transform.num_classes={t.num_classes})"
            )
        return box_array.reshape(-1), label_array

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        t = self.transform
        rows = [
            self._row(i, image, boxes, labels)
            for i, image, boxes, labels in zip(
                batch["id"],
                batch[t.image_column],
                batch[t.boxes_column],
                batch[t.labels_column],
                strict=True,
            )
        ]
        return {
            "image": batch[t.image_column],
            "boxes": [boxes for boxes, _ in rows],
            "labels": [labels for _, labels in rows],
        }


def _detection(
    config: DataConfig, transform: DetectionTransform, split: str, ds: datasets.Dataset
) -> datasets.Dataset:
    """Check every image, box and label of a split and write them as the detection columns."""
    where = describe_split(config, split)
    for column in (transform.image_column, transform.boxes_column, transform.labels_column):
        _require_column(config, split, ds, column)
    if getattr(ds.features[transform.image_column], "dtype", None) not in (
        "binary",
        "large_binary",
    ):
        raise DataError(
            f"column {transform.image_column!r} of {where} holds "
            f"{ds.features[transform.image_column]}, not encoded image bytes"
        )
    if len(ds) == 0:
        raise DataError(f"{where} has no images")
    keep = list(DETECTION_COLUMNS)
    mapped = ds.map(
        _DetectionRows(transform, where),
        batched=True,
        num_proc=num_processes(config, len(ds)),
        remove_columns=[c for c in ds.column_names if c != "id"],
        features=datasets.Features(
            {
                "id": ds.features["id"],
                "image": datasets.Value("binary"),
                "boxes": datasets.Sequence(datasets.Value("float32")),
                "labels": datasets.Sequence(datasets.Value("int64")),
            }
        ),
        desc=f"checking {split}",
    )
    return mapped.select_columns(["id", *keep])


def apply_transform(
    config: DataConfig,
    split: str,
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase | None,
) -> tuple[datasets.Dataset, int]:
    """Turn one split's rows into the output columns.

    Args:
        config: The data config (its `transform` decides what happens).
        split: Split name, for error messages.
        ds: The split's rows.
        tokenizer: Loaded tokenizer for the token transforms, else None.

    Returns:
        The dataset with exactly `output_columns(config)` and the number of rows dropped for
        exceeding `max_length`.

    Raises:
        DataError: On a missing column, a wrong type, or a split left empty; the message names
            the column and split.
    """
    transform = config.transform
    ds = _with_ids(config, split, ds)
    if isinstance(transform, TabularTransform):
        typed = _cast_scalars(config, split, ds, transform.columns)
        return typed.select_columns(list(output_columns(config))), 0
    if isinstance(transform, DetectionTransform):
        return _detection(config, transform, split, ds), 0

    assert tokenizer is not None
    ds = _cast_scalars(config, split, ds, transform.keep_columns)
    if isinstance(transform, ChatTransform):
        column = transform.messages_column
        _require_column(config, split, ds, column)
        inner = getattr(ds.features[column], "feature", None)
        if not isinstance(inner, dict) or not {"role", "content"} <= set(inner):
            raise DataError(
                f"column {column!r} of {describe_split(config, split)} holds "
                f"{ds.features[column]}, not a list of {{'role', 'content'}} messages"
            )
        fn: Any = _ChatTokenizer(tokenizer, column, split)
    else:
        column = transform.text_column
        _require_column(config, split, ds, column)
        if getattr(ds.features[column], "dtype", None) not in ("string", "large_string"):
            raise DataError(
                f"column {column!r} of {describe_split(config, split)} holds "
                f"{ds.features[column]}, not text"
            )
        fn = _TextTokenizer(tokenizer, column, transform.add_eos)

    keep = list(output_columns(config))
    num_rows = len(ds)
    num_proc = num_processes(config, num_rows)
    ds = ds.map(
        fn,
        batched=True,
        num_proc=num_proc,
        remove_columns=[c for c in ds.column_names if c not in keep],
        desc=f"tokenizing {split}",
    )
    ds = _fit_length(transform, ds, num_proc)
    if isinstance(transform, ChatTransform) and transform.turns:
        ds = ds.map(
            lambda ids, mask: {"turns": chat_turns(ids, mask)},
            input_columns=["input_ids", "assistant_masks"],
            num_proc=num_proc,
        )
    ds = ds.select_columns(keep)
    if len(ds) == 0:
        raise DataError(
            f"{describe_split(config, split)} is empty after the {transform.name!r} transform "
            f"(every row is longer than max_length {transform.max_length})"
        )
    return ds, num_rows - len(ds)
