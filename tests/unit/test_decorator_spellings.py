"""`@distributed` in both spellings: `num_accelerators`/`accelerator_type` and the earlier
`gpus`/`gpu_type`. What each maps to, what is refused at decoration, the default count and
timeout, `with_overrides` and `.func`. Nothing here launches ranks (tests/distributed does);
GPU inventories other than this machine's are mocked, and named so."""

import os
import pickle
import warnings

import pytest

from trainflow import DistributedFunction, RemoteNotConfiguredError, ResourceError, distributed
from trainflow.launch import decorator
from trainflow.launch.plan import ACCELERATOR_TYPES, GpuInventory, place

H100x8 = GpuInventory(("NVIDIA H100 80GB HBM3",) * 8)
A10x2 = GpuInventory(("NVIDIA A10",) * 2)
NO_GPU = GpuInventory(())
VALID = ("GPU_1xA10", "GPU_1xH100", "GPU_8xH100", "GPU_8xB300")


def add_one(x: int) -> int:
    return x + 1


def _placed(fn: DistributedFunction) -> tuple:
    o = fn.options
    return o.gpus, o.gpu_type, o.nnodes


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((), {"num_accelerators": 16, "accelerator_type": "GPU_8xH100"}, (16, "H100", 2)),
        ((), {"num_accelerators": 2, "accelerator_type": "GPU_8xH100"}, (2, "H100", 1)),
        ((), {"num_accelerators": 8, "accelerator_type": "GPU_8xH100"}, (8, "H100", 1)),
        ((), {"num_accelerators": 2, "accelerator_type": "GPU_1xA10"}, (2, "A10", 2)),
        ((), {"num_accelerators": 3, "accelerator_type": "GPU_1xH100"}, (3, "H100", 3)),
        ((), {"num_accelerators": 24, "accelerator_type": "GPU_8xB300"}, (24, "B300", 3)),
        ((16, "GPU_8xH100"), {}, (16, "H100", 2)),
        ((), {"gpus": 2, "gpu_type": "cpu"}, (2, "cpu", 1)),
        ((), {"gpus": 16, "gpu_type": "H100", "nnodes": 2}, (16, "H100", 2)),
        ((2,), {}, (2, None, 1)),
        ((2, "cpu"), {}, (2, "cpu", 1)),
        ((8, "H100"), {}, (8, "H100", 1)),
        ((2,), {"gpu_type": "cpu"}, (2, "cpu", 1)),
        ((), {"num_accelerators": 4, "nnodes": 2}, (4, None, 2)),
    ],
)
def test_both_spellings_map_to_ranks_gpu_type_and_nodes(args, kwargs, expected):
    assert _placed(distributed(*args, **kwargs)(add_one)) == expected


def test_nnodes_given_with_an_accelerator_type_may_only_agree():
    agreed = distributed(num_accelerators=16, accelerator_type="GPU_8xH100", nnodes=2)(add_one)
    assert _placed(agreed) == (16, "H100", 2)
    with pytest.raises(
        ResourceError, match="nnodes=3 disagrees with accelerator_type='GPU_8xH100'"
    ):
        distributed(num_accelerators=16, accelerator_type="GPU_8xH100", nnodes=3)


@pytest.mark.parametrize("name", ["GPU_4xH100", "GPU_8xA100", "gpu_8xh100", "GPU_1xA100"])
def test_an_unknown_accelerator_type_is_refused_naming_the_field_and_the_valid_types(name):
    with pytest.raises(ResourceError) as info:
        distributed(num_accelerators=1, accelerator_type=name)
    message = str(info.value)
    assert f"accelerator_type={name!r}" in message
    assert all(valid in message for valid in VALID)
    assert tuple(ACCELERATOR_TYPES) == VALID


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_accelerators": 12, "accelerator_type": "GPU_8xH100"},
            r"num_accelerators=12 does not fit accelerator_type='GPU_8xH100' \(8 H100 per node\)"
            r".*at most 8.*multiple of 8",
        ),
        (
            {"num_accelerators": 0, "accelerator_type": "GPU_8xH100"},
            "num_accelerators must be a positive integer, got 0",
        ),
        ({"num_accelerators": -8}, "num_accelerators must be a positive integer, got -8"),
        ({"num_accelerators": True}, "num_accelerators must be a positive integer, got True"),
        ({"num_accelerators": 2.0}, "num_accelerators must be a positive integer, got 2.0"),
        ({"gpus": 0}, "gpus must be a positive integer, got 0"),
        (
            {"gpus": 12, "accelerator_type": "GPU_8xH100"},
            "gpus=12 does not fit accelerator_type='GPU_8xH100'",
        ),
    ],
)
def test_a_count_the_request_cannot_hold_is_refused_at_decoration(kwargs, message):
    with pytest.raises(ResourceError, match=message):
        distributed(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"num_accelerators": 8, "gpus": 8}, ("num_accelerators=8", "gpus=8")),
        (
            {"accelerator_type": "GPU_8xH100", "gpu_type": "H100"},
            ("accelerator_type='GPU_8xH100'", "gpu_type='H100'"),
        ),
    ],
)
def test_one_setting_under_both_names_is_refused_naming_both(kwargs, names):
    with pytest.raises(ResourceError) as info:
        distributed(**kwargs)
    assert all(name in str(info.value) for name in names)


def test_the_earlier_names_raise_no_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        earlier = distributed(gpus=2, gpu_type="cpu")(add_one)
        distributed(2, "cpu")(add_one)
        distributed(gpus=16, gpu_type="H100", nnodes=2, timeout=60)(add_one)
        earlier.with_overrides(num_accelerators=4)
    assert [str(w.message) for w in caught] == []


def test_the_default_count_is_every_attached_gpu_with_mocked_inventories(monkeypatch):
    assert place(None, None, inventory=H100x8).gpus == 8
    assert place(None, "GPU_8xH100", inventory=H100x8) == (8, "H100", 1)
    # One node of the type at most: a machine with more GPUs than the type's node has.
    assert place(None, "GPU_1xH100", inventory=H100x8) == (1, "H100", 1)
    assert place(None, "GPU_1xA10", inventory=A10x2) == (1, "A10", 1)
    # No GPU: one rank, CPU by `resolve_resources` (gpu_type None, or the CPU fallback).
    assert place(None, None, inventory=NO_GPU) == (1, None, 1)
    assert place(None, "GPU_8xH100", inventory=NO_GPU) == (1, "H100", 1)
    # A remote call: one node of the type, whatever this machine has.
    assert place(None, "GPU_8xH100", remote=True, inventory=NO_GPU) == (8, "H100", 1)
    with pytest.raises(ResourceError, match="remote=True with num_accelerators=None needs"):
        place(None, None, remote=True, inventory=H100x8)


def test_the_default_count_on_this_machine_is_its_gpus_or_one_cpu_rank():
    attached = GpuInventory.detect().count
    assert distributed()(add_one).options.gpus == (attached or 1)
    assert distributed(remote=True, accelerator_type="GPU_8xH100")(add_one).options.gpus == 8


def test_the_new_spelling_defaults_to_three_hours_and_says_so():
    assert decorator.DEFAULT_TIMEOUT_S == 10800
    fn = distributed(num_accelerators=2, accelerator_type="GPU_8xH100")(add_one)
    assert fn.options.timeout == 10800
    assert fn.timeout_note() == (
        "[trainflow] Note: add_one.distributed() stops its ranks after 3 h "
        "(timeout=10800 s, the default); pass timeout=None to run without a limit."
    )
    assert distributed(2)(add_one).options.timeout == 10800
    assert distributed(remote=True, accelerator_type="GPU_1xA10")(add_one).options.timeout == 10800


@pytest.mark.parametrize(
    ("args", "kwargs", "timeout"),
    [
        ((), {"num_accelerators": 2, "accelerator_type": "GPU_8xH100", "timeout": None}, None),
        ((2, "GPU_8xH100", False, 60), {}, 60),
        ((), {"num_accelerators": 2, "timeout": 10800}, 10800),
        ((), {"gpus": 2, "gpu_type": "cpu"}, None),
        ((2, "cpu"), {}, None),
        ((2,), {"gpu_type": "H100"}, None),
        ((), {"gpus": 2, "accelerator_type": "GPU_8xH100"}, None),
    ],
)
def test_no_note_where_the_timeout_is_given_or_the_spelling_is_the_earlier_one(
    args, kwargs, timeout
):
    fn = distributed(*args, **kwargs)(add_one)
    assert fn.options.timeout == timeout
    assert fn.timeout_note() is None


def test_the_note_is_printed_once_per_call_before_anything_runs(monkeypatch, capsys):
    """A remote call with no deployment configured fails before anything is submitted: the
    note comes first, once per call."""
    for name in list(os.environ):
        if name.startswith("TRAINFLOW_REMOTE_DEPLOYMENT"):
            monkeypatch.delenv(name)
    fn = distributed(accelerator_type="GPU_1xH100", remote=True)(add_one)
    for _ in range(2):
        with pytest.raises(RemoteNotConfiguredError, match="TRAINFLOW_REMOTE_DEPLOYMENT_H100"):
            fn.distributed(1)
        assert capsys.readouterr().err.count("stops its ranks after 3 h") == 1
    quiet = fn.with_overrides(timeout=None)
    with pytest.raises(RemoteNotConfiguredError):
        quiet.distributed(1)
    assert "Note:" not in capsys.readouterr().err


def test_with_overrides_returns_a_new_function_and_leaves_the_original_alone():
    base = distributed(
        num_accelerators=2, accelerator_type="GPU_8xH100", env={"A": "1"}, max_restarts=1
    )(add_one)
    before = base.options
    bigger = base.with_overrides(num_accelerators=16)
    assert bigger is not base and isinstance(bigger, DistributedFunction)
    assert base.options == before and _placed(base) == (2, "H100", 1)
    assert _placed(bigger) == (16, "H100", 2)
    assert (bigger.options.env, bigger.options.max_restarts) == ({"A": "1"}, 1)
    assert bigger.timeout_note() is not None  # still the default timeout

    a10 = base.with_overrides(accelerator_type="GPU_1xA10")
    assert _placed(a10) == (2, "A10", 2)
    unlimited = base.with_overrides(timeout=None, remote=True)
    assert (unlimited.options.timeout, unlimited.options.remote) == (None, True)
    assert unlimited.timeout_note() is None
    assert base.with_overrides(timeout=30).options.timeout == 30
    assert base.options == before


def test_with_overrides_on_the_earlier_spelling():
    earlier = distributed(gpus=2, gpu_type="cpu", nnodes=2)(add_one)
    assert _placed(earlier.with_overrides(num_accelerators=4)) == (4, "cpu", 2)
    assert _placed(earlier.with_overrides(accelerator_type="GPU_8xH100")) == (2, "H100", 1)
    assert earlier.with_overrides(num_accelerators=4).options.timeout is None


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"num_accelerators": 12}, ResourceError, "num_accelerators=12 does not fit"),
        ({"num_accelerators": 0}, ResourceError, "num_accelerators must be a positive"),
        ({"accelerator_type": "GPU_2xH100"}, ResourceError, "GPU_1xA10, GPU_1xH100"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds"),
    ],
)
def test_with_overrides_checks_what_it_is_given_as_the_decorator_does(overrides, error, message):
    base = distributed(num_accelerators=2, accelerator_type="GPU_8xH100")(add_one)
    with pytest.raises(error, match=message):
        base.with_overrides(**overrides)


def test_func_is_the_plain_function_and_a_direct_call_runs_in_process():
    fn = distributed(num_accelerators=2, accelerator_type="GPU_8xH100")(add_one)
    assert fn.func is add_one
    assert fn.with_overrides(num_accelerators=1).func is add_one
    assert fn(41) == 42
    assert fn.__name__ == "add_one"


def test_a_decorated_function_pickles_with_its_request_and_default():
    fn = distributed(num_accelerators=2, accelerator_type="GPU_1xA10")(add_one)
    back = pickle.loads(pickle.dumps(fn))
    assert back.options == fn.options and back.request == fn.request
    assert back.timeout_note() == fn.timeout_note() is not None
    assert back.func is add_one
    assert _placed(back.with_overrides(num_accelerators=4)) == (4, "A10", 4)
