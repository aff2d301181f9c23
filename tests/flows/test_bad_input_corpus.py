"""A corpus of bad inputs: every one is refused before anything starts, naming what is wrong.

Each command-line case runs the pipeline's real entry point (`flows.<name>.main(argv)`, what
`python -m flows.<name>` calls) and each deployment case runs the real flow on a real Prefect
server with the parameters a deployment would pass. Every case asserts:

- a non-zero exit (or a failed flow run) within `BOUND_S`;
- the message names the field, option or file (and, for a bad row, its line);
- no rank started: no launch folder under TRAINFLOW_HOME/runs, no new child process;
- no MLflow run or model version: the test's store was never even created, or holds none.

This machine has no GPU, so asking for one is a real bad input here.
"""

import json
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

import flows.mlp
import flows.prepare
import flows.sft
import flows.transformer
from tests.conftest import REPO_ROOT
from trainflow.launch.plan import GpuInventory
from trainflow.paths import trainflow_home

pytestmark = pytest.mark.skipif(
    GpuInventory.detect().count > 0, reason="this machine has GPUs, so asking for one is no error"
)

# Imported here, not inside a case: Prefect's console log handler binds the stderr it first
# sees, which inside a case is that case's capture.
PIPELINES = {
    m.__name__.split(".")[1]: m for m in (flows.mlp, flows.prepare, flows.sft, flows.transformer)
}

BOUND_S = 30  # per case; rejections take well under a second once the modules are imported

TURNS = [{"role": "user", "content": "add 1 2"}, {"role": "assistant", "content": "3"}]
ROW = json.dumps({"messages": TURNS})


def _data_config(**update: object) -> dict:
    """A valid `flows.prepare` config (the shipped interactions CSV) with `update` applied."""
    config = {
        "name": "clicks",
        "source": {"kind": "files", "files": {"train": [str(REPO_ROOT / "data/interactions.csv")]}},
        "transform": {"name": "tabular", "columns": {"user_id": "int64", "clicked": "float32"}},
    }
    return config | update


# Files the cases point at, written into the test's folder: name -> text.
FILES: dict[str, str] = {
    "garbage.jsonl": f"{ROW}\n{ROW}\n\x00\x01binary\n",
    "blank.jsonl": "\n   \n\n",
    "truncated.jsonl": f"{ROW}\n{ROW[:25]}\n",
    "no_messages.jsonl": json.dumps({"conversation": TURNS}) + "\n",
    "array_of_lists.json": "[[1, 2], [3]]",
    "empty.jsonl": "",
    "list_row.jsonl": f"{ROW}\n[1, 2]\n",
    "chats.csv": "text,label\nhello,1\n",
    "list.yaml": "- gpus\n- 2\n",
    "broken.yaml": "gpus: [2\n",
    "unknown_field.yaml": "gpus: 2\nnum_gpu: 4\n",
    "header_only.csv": "user_id,clicked\n",
    "bad_row.jsonl": '{"text": "ok"}\n{"text": \n',
    "prep_missing_file.yaml": json.dumps(
        _data_config(source={"kind": "files", "files": {"train": ["/nonexistent/clicks.csv"]}})
    ),
    "prep_bad_compression.yaml": json.dumps(_data_config(compression="zip9")),
    "prep_bad_shard_size.yaml": json.dumps(_data_config(shard_size="huge")),
    "prep_missing_column.yaml": json.dumps(
        _data_config(transform={"name": "tabular", "columns": {"user_id": "int64", "price": "f"}})
    ),
    "prep_missing_column_ok_type.yaml": json.dumps(
        _data_config(
            transform={"name": "tabular", "columns": {"user_id": "int64", "price": "float32"}}
        )
    ),
    "prep_unknown_transform.yaml": json.dumps(_data_config(transform={"name": "audio"})),
    "prep_bad_hashes.yaml": json.dumps(_data_config(hashes=["md7"])),
    "prep_header_only.yaml": json.dumps(
        _data_config(source={"kind": "files", "files": {"train": ["{dir}/header_only.csv"]}})
    ),
    "prep_bad_row.yaml": json.dumps(
        _data_config(
            source={"kind": "files", "files": {"train": ["{dir}/bad_row.jsonl"]}},
            transform={"name": "text", "tokenizer": str(REPO_ROOT / "data/tokenizer")},
        )
    ),
    "prep_unknown_split.yaml": json.dumps(_data_config(splits=["test"])),
    "prep_id_reserved.yaml": json.dumps(
        _data_config(transform={"name": "tabular", "columns": {"id": "int64"}})
    ),
    "prep_no_columns.yaml": json.dumps(_data_config(transform={"name": "tabular", "columns": {}})),
}


@dataclass(frozen=True)
class Case:
    """`python -m flows.<pipeline> ARGV` must exit non-zero naming `names` (every one of them)."""

    pipeline: str
    argv: tuple[str, ...]
    names: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.pipeline} {' '.join(self.argv)}"[:90]


def _c(pipeline: str, argv: str | list[str], *names: str) -> Case:
    return Case(pipeline, tuple(argv.split() if isinstance(argv, str) else argv), names)


CLI_CASES = [
    # --- mlp: placement, numbers, names, files ---
    _c("mlp", "--gpus 0", "--gpus"),
    _c("mlp", "--gpus -1", "--gpus"),
    _c("mlp", "--gpus two", "--gpus", "two"),
    _c("mlp", "--gpu-type A100", "gpu_type='A100'"),
    _c("mlp", "--gpus 999 --gpu-type cpu --num-train-samples 100000", "gpus=999"),
    _c("mlp", "--nnodes 0", "--nnodes"),
    _c("mlp", "--min-r2 nan", "--min-r2"),
    _c("mlp", "--learning-rate inf", "--learning-rate"),
    _c("mlp", "--learning-rate 0", "--learning-rate"),
    _c("mlp", "--noise-std -1", "--noise-std"),
    _c("mlp", "--batch-size 0", "--batch-size"),
    _c("mlp", "--batch-size 100000", "batch_size=100000", "num_train_samples"),
    _c("mlp", "--num-epochs 0", "--num-epochs"),
    _c("mlp", "--num-train-samples 2", "--num-train-samples"),
    _c("mlp", "--max-steps 0", "--max-steps"),
    _c("mlp", "--seed 1.5", "--seed"),
    _c("mlp", "--experiment-name ../escape", "--experiment-name"),
    _c("mlp", ["--registered-model-name", "a b/c"], "--registered-model-name"),
    _c("mlp", "--backend mpi", "--backend", "mpi"),
    _c("mlp", "--backend nccl --gpu-type cpu", "backend='nccl'", "gpu_type='cpu'"),
    _c("mlp", "--checkpoint-every -1", "--checkpoint-every"),
    _c("mlp", "--keep-checkpoints 0", "--keep-checkpoints"),
    _c("mlp", "--timeout-s 0", "--timeout-s"),
    _c("mlp", "--max-restarts -1", "--max-restarts"),
    _c("mlp", "--retries -1", "--retries"),
    _c("mlp", "--stop-grace-s nan", "--stop-grace-s"),
    _c("mlp", "--nosuch-option 1", "--nosuch-option"),
    _c("mlp", "--resume nosuchrun", "--resume nosuchrun"),
    _c("mlp", "--resume ../../etc", "--resume"),
    _c("mlp", "--config /nonexistent/mlp.yaml", "--config /nonexistent/mlp.yaml"),
    _c("mlp", "--config {dir}/list.yaml", "list.yaml", "mapping"),
    _c("mlp", "--config {dir}/broken.yaml", "broken.yaml", "YAML"),
    _c("mlp", "--config {dir}/unknown_field.yaml", "'num_gpu' is not an option"),
    # --- transformer: nested fields and techniques ---
    _c("transformer", "--model-num-heads 7", "model.num_heads=7", "model.d_model"),
    _c("transformer", "--model-vocab-size 1", "--model-vocab-size"),
    _c("transformer", "--model-num-layers 0", "--model-num-layers"),
    _c("transformer", "--training-global-batch-size 15", "training.global_batch_size=15"),
    _c("transformer", "--training-grad-accum-steps 0", "--training-grad-accum-steps"),
    _c("transformer", "--training-optimizer-learning-rate nan", "learning-rate"),
    _c("transformer", "--data-signal 2", "--data-signal"),
    _c("transformer", "--min-eval-accuracy 1.5", "--min-eval-accuracy"),
    _c("transformer", "--technique nosuch", "--technique", "nosuch"),
    _c("transformer", ["--technique", '{"name": "fsdp", "nosuch": 1}'], "nosuch"),
    _c(
        "transformer",
        ["--technique", '{"name": "deepspeed", "zero_stage": 5}'],
        "--technique: deepspeed.zero_stage",
    ),
    _c("transformer", "--collective-timeout-s 0", "--collective-timeout-s"),
    _c("transformer", "--hang-timeout-s -5", "--hang-timeout-s"),
    _c("transformer", "--gpu-type H100", "gpu_type='H100'"),
    # --- sft: names the ranks would fail on, datasets and their rows ---
    _c("sft", "--dataset /nonexistent/data.jsonl", "/nonexistent/data.jsonl", "does not exist"),
    _c("sft", "--dataset nosuchpreset", "nosuchpreset"),
    _c("sft", "--training-lr-scheduler nosuch", "training.lr_scheduler='nosuch'"),
    _c(
        "sft",
        ["--lora", "--lora-settings-target-modules", '["nosuch_proj"]'],
        "lora_settings.target_modules",
        "nosuch_proj",
    ),
    _c("sft", "--dataset {dir}/garbage.jsonl", "garbage.jsonl", "line 3"),
    _c("sft", "--dataset {dir}/blank.jsonl", "blank.jsonl", "blank"),
    _c("sft", "--dataset {dir}/truncated.jsonl", "truncated.jsonl", "line 2, column"),
    _c("sft", "--dataset {dir}/no_messages.jsonl", "line 1", "no column 'messages'"),
    _c("sft", "--dataset {dir}/array_of_lists.json", "array_of_lists.json", "row 1"),
    _c("sft", "--dataset {dir}/empty.jsonl", "empty.jsonl", "is empty"),
    _c("sft", "--dataset {dir}/list_row.jsonl", "list_row.jsonl", "line 2"),
    _c("sft", "--dataset {dir}/chats.csv", "chats.csv", "no column 'messages'"),
    _c("sft", "--max-length 4", "--max-length"),
    _c("sft", "--validation-fraction 1", "--validation-fraction"),
    _c("sft", "--lora-settings-r 0", "--lora-settings-r"),
    _c("sft", "--lora-settings-dropout 1", "--lora-settings-dropout"),
    _c("sft", "--evaluation-min-exact-match 2", "--evaluation-min-exact-match"),
    _c("sft", "--evaluation-max-loss-ratio 0", "--evaluation-max-loss-ratio"),
    _c("sft", "--training-per-device-batch-size 0", "--training-per-device-batch-size"),
    _c("sft", "--max-steps 0", "--max-steps"),
    _c("sft", "--preset nosuch", "--preset", "nosuch"),
    _c("sft", ["--technique", '{"name": "ddp", "nosuch": 1}'], "nosuch"),
    _c("sft", "--gpu-type H100", "gpu_type='H100'"),
    _c("sft", "--config {dir}/list.yaml", "list.yaml", "mapping"),
    # --- prepare: data configs ---
    _c("prepare", "--preset nosuch", "--preset", "nosuch"),
    _c("prepare", "--config {dir}/prep_missing_file.yaml", "/nonexistent/clicks.csv"),
    _c("prepare", "--config {dir}/prep_bad_compression.yaml", "compression", "zip9"),
    _c("prepare", "--config {dir}/prep_bad_shard_size.yaml", "shard_size", "huge"),
    _c("prepare", "--config {dir}/prep_missing_column.yaml", "columns"),
    _c("prepare", "--config {dir}/prep_missing_column_ok_type.yaml", "no column 'price'"),
    _c("prepare", "--config {dir}/prep_unknown_transform.yaml", "transform", "audio"),
    _c("prepare", "--config {dir}/prep_bad_hashes.yaml", "hashes", "md7"),
    _c("prepare", "--config {dir}/prep_header_only.yaml", "header_only.csv", "no rows"),
    _c("prepare", "--config {dir}/prep_bad_row.yaml", "bad_row.jsonl", "line 2"),
    _c("prepare", "--config {dir}/prep_unknown_split.yaml", "splits", "test"),
    _c("prepare", "--config {dir}/prep_id_reserved.yaml", "'id' is reserved"),
    _c("prepare", "--config {dir}/prep_no_columns.yaml", "columns"),
    _c("prepare", "--name ../escape", "--name"),
    _c("prepare", "--num-proc 0", "--num-proc"),
]

# What a deployment (or a run started from the UI) passes: flow name -> its `config` parameter.
DEPLOYMENT_CASES = [
    ("mlp", {"gpus": 0}, ("gpus",)),
    ("mlp", {"gpu_type": "A100"}, ("gpu_type='A100'",)),
    ("mlp", {"min_r2": float("nan")}, ("min_r2",)),
    ("mlp", {"num_gpu": 4}, ("num_gpu",)),
    ("mlp", {"experiment_name": "../escape"}, ("experiment_name",)),
    ("transformer", {"model": {"num_heads": 7}}, ("model.num_heads=7",)),
    ("transformer", {"technique": {"name": "nosuch"}}, ("technique", "nosuch")),
    ("transformer", {"training": {"global_batch_size": 15}}, ("training.global_batch_size=15",)),
    ("sft", {"training": {"lr_scheduler": "nosuch"}}, ("training.lr_scheduler='nosuch'",)),
    ("sft", {"dataset": "/nonexistent/data.jsonl"}, ("/nonexistent/data.jsonl",)),
    (
        "sft",
        {"lora": True, "lora_settings": {"target_modules": ["nosuch_proj"]}},
        ("nosuch_proj",),
    ),
    ("sft", {"dataset": "{dir}/truncated.jsonl"}, ("truncated.jsonl", "line 2")),
]

REJECT_TIMES: list[float] = []  # seconds to reject, per command-line case, for the summary


@pytest.fixture
def files(tmp_path: Path) -> Path:
    folder = tmp_path / "inputs"
    folder.mkdir()
    for name, text in FILES.items():
        (folder / name).write_text(text.replace("{dir}", str(folder)))
    return folder


@contextmanager
def _bounded(seconds: int) -> Iterator[None]:
    """Fail the case, rather than train, if it is not refused within `seconds`."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"not refused within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _flow_runs(flow_name: str) -> dict[str, str]:
    """Flow run id -> state type of every run of `flow_name` on the Prefect server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))
    return {str(r.id): r.state.type.value for r in runs}


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _assert_nothing_started(tmp_path: Path, children_before: set[int]) -> None:
    assert not (trainflow_home() / "runs").exists(), "a launch folder was created: ranks started"
    assert _children() <= children_before, "a process was started"
    store = tmp_path / "mlflow.db"
    if store.exists():  # created by a check; it must hold no run and no model version
        client = MlflowClient(tracking_uri=f"sqlite:///{store}")
        experiments = [e.experiment_id for e in client.search_experiments()]
        assert not experiments or client.search_runs(experiments) == []
        assert client.search_model_versions() == []


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: c.id)
def test_command_line_refuses_before_anything_starts(case, files, tmp_path, capsys):
    main = PIPELINES[case.pipeline].main
    argv = [arg.replace("{dir}", str(files)) for arg in case.argv]
    before = _children()
    started = time.monotonic()
    with _bounded(BOUND_S), pytest.raises(SystemExit) as info:
        main(argv)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert info.value.code not in (0, None), err
    assert "Traceback" not in err
    for name in case.names:
        assert name.replace("{dir}", str(files)) in err, f"{name!r} not named in: {err}"
    _assert_nothing_started(tmp_path, before)
    REJECT_TIMES.append(elapsed)


@pytest.mark.parametrize(
    ("pipeline", "config", "names"),
    DEPLOYMENT_CASES,
    ids=[f"{p} {json.dumps(c)}"[:90] for p, c, _ in DEPLOYMENT_CASES],
)
def test_deployment_parameters_fail_the_flow_run_before_anything_starts(
    prefect_api, pipeline, config, names, files, tmp_path
):
    flow = getattr(PIPELINES[pipeline], pipeline)
    config = json.loads(json.dumps(config).replace("{dir}", str(files)))
    runs_before = _flow_runs(pipeline)
    before = _children()
    started = time.monotonic()
    with _bounded(BOUND_S), pytest.raises(Exception) as info:
        flow(config=config)
    assert time.monotonic() - started < BOUND_S
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"
    new_runs = {k: v for k, v in _flow_runs(pipeline).items() if k not in runs_before}
    assert list(new_runs.values()) == ["FAILED"]  # one run, failed: what the UI shows
    _assert_nothing_started(tmp_path, before)


def test_corpus_size_and_time_to_reject():
    """The corpus covers every pipeline; prints the median time to reject (run with -s)."""
    assert len(CLI_CASES) + len(DEPLOYMENT_CASES) >= 60
    assert {c.pipeline for c in CLI_CASES} == {"mlp", "transformer", "sft", "prepare"}
    if REJECT_TIMES:
        print(
            f"\n{len(REJECT_TIMES)} command-line cases rejected; median "
            f"{statistics.median(REJECT_TIMES) * 1000:.0f} ms, max {max(REJECT_TIMES):.2f} s"
        )
