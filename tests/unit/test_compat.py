"""Every patch into another package: in its version range, still able to apply, and tested for
what it fixes; the version check warns or refuses as each patch declares."""

import ast
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import trainflow
from trainflow.compat import (
    cpu_fallback,  # noqa: F401 - imports the torch, transformers, Lightning, DeepSpeed patches
    mlflow,  # noqa: F401
    patching,
    prefect,  # noqa: F401
    ray,  # noqa: F401
    safe_load,  # noqa: F401
    stdlib,  # noqa: F401
)
from trainflow.compat.patching import PATCHES, CompatError, CompatWarning

ROOT = Path(trainflow.__file__).parent.parent

# The test that shows each patch doing its job, and fails when an upgrade breaks it.
BEHAVIOUR = {
    "torch: c10d_rendezvous_backend.TCPStore": "tests/distributed/test_launch_defects.py::"
    "test_a_launch_listens_on_loopback_only",
    "torch: DynamicRendezvousHandler._create_tcp_store_server": "tests/distributed/"
    "test_launch_defects.py::test_a_launch_listens_on_loopback_only",
    "torch: LocalElasticAgent._stop_workers": "tests/distributed/test_stop_grace.py::"
    "test_survivors_of_a_failed_attempt_are_stopped_at_once_for_the_restart",
    "torch: LocalElasticAgent._shutdown": "tests/distributed/test_stop_grace.py::"
    "test_survivors_of_a_failed_attempt_are_stopped_at_once_for_the_restart",
    "torch: dynamic_rendezvous.get_method_name": "tests/unit/test_compat.py::"
    "test_rendezvous_events_are_named_from_the_frame_as_torch_names_them",
    "torch: distributed_c10d.init_process_group": "tests/distributed/test_notebook_cells.py::"
    "test_torch_cell_that_asks_for_nccl_runs_on_gloo",
    "torch: distributed_c10d.new_group": "tests/unit/test_compat.py::"
    "test_gpu_calls_on_a_cpu_rank_run_on_the_cpu",
    "torch: cuda.set_device": "tests/distributed/test_notebook_cells.py::"
    "test_torch_cell_that_asks_for_nccl_runs_on_gloo",
    "torch: device_mesh.init_device_mesh": "tests/unit/test_compat.py::"
    "test_gpu_calls_on_a_cpu_rank_run_on_the_cpu",
    "torch: amp.autocast.__init__": "tests/distributed/test_notebook_cells.py::"
    "test_torch_cell_that_asks_for_nccl_runs_on_gloo",
    "torch: DistributedDataParallel.__init__": "tests/distributed/test_notebook_cells.py::"
    "test_torch_cell_that_asks_for_nccl_runs_on_gloo",
    "torch: cuda._lazy_init": "tests/distributed/test_notebook_fallback.py::"
    "test_moving_a_tensor_to_cuda_names_the_fallback_and_what_to_change",
    "transformers: TrainingArguments.__post_init__": "tests/distributed/test_notebook_cells.py::"
    "test_sft_trainer_cell_trains_over_both_ranks",
    "transformers: Trainer.create_accelerator_and_postprocess": "tests/distributed/"
    "test_notebook_cells.py::test_sft_trainer_cell_trains_over_both_ranks",
    "transformers: Trainer.save_model (_internal_call)": "tests/distributed/test_rank_data.py::"
    "test_the_trainer_resumes_at_the_next_unseen_sample",
    "transformers: Trainer._save_optimizer_and_scheduler": "tests/distributed/"
    "test_rank_data.py::test_the_trainer_resumes_at_the_next_unseen_sample",
    "accelerate: AcceleratorState.fsdp_plugin, distributed_type": "tests/distributed/"
    "test_notebook_cells.py::test_sft_trainer_cell_trains_over_both_ranks",
    "accelerate: PartialState.__init__": "tests/distributed/test_notebook_cells.py::"
    "test_a_framework_left_single_process_fails_naming_it",
    "accelerate: utils.other.is_deepspeed_available (extract_model_from_parallel)": "tests/unit/"
    "test_compat.py::test_unwrapping_a_model_imports_deepspeed_only_where_it_is_loaded",
    "lightning: Trainer.__init__": "tests/distributed/test_notebook_cells.py::"
    "test_lightning_cell_with_devices_auto_trains_over_both_ranks",
    "lightning: Trainer._signal_connector (_SignalConnector)": "tests/flows/test_resume.py::"
    "test_two_tower_sigterm_checkpoints_the_step_reached_and_resume_trains_only_the_rest",
    "deepspeed: ops.__compatible_ops__": "tests/distributed/test_notebook_cells.py::"
    "test_deepspeed_cell_compiles_nothing",
    "deepspeed: initialize": "tests/distributed/test_notebook_cells.py::"
    "test_sft_trainer_cell_trains_over_both_ranks",
    "mlflow: requirements_utils._MODULES_TO_PACKAGES": "tests/unit/test_package_map.py::"
    "test_the_map_is_built_once_then_read_back",
    "mlflow: requirements_utils._init_modules_to_packages_map": "tests/unit/"
    "test_package_map.py::test_the_map_is_built_once_then_read_back",
    "ray: _private.state.available_resources_per_node": "tests/distributed/"
    "test_ray_multinode.py::test_an_elastic_range_grows_when_a_node_frees_up_and_resumes",
    "prefect: server.api.server:create_app (SubprocessASGIServer's command)": "tests/flows/"
    "test_safety.py::test_local_prefect_server_started_by_a_run_listens_on_loopback_only",
    "prefect: PREFECT__SERVER_EPHEMERAL, PREFECT__SERVER_FINAL": "tests/flows/"
    "test_database_template.py::test_a_new_home_is_seeded_and_its_server_runs_a_flow_on_it",
    "python: atexit._run_exitfuncs": "tests/unit/test_compat.py::"
    "test_exit_now_runs_the_exit_handlers_and_keeps_the_code",
    "python: atexit._clear": "tests/unit/test_compat.py::test_cleared_exit_handlers_do_not_run",
    "torch: FileSystemReader.read_metadata": "tests/unit/test_checkpoint_safety.py::"
    "test_pickle_in_dcp_metadata_is_refused_by_resume_and_by_dcp_itself",
    "torch: FileSystemReader.read_data": "tests/unit/test_checkpoint_safety.py::"
    "test_pickle_in_a_dcp_value_is_refused_naming_its_file",
    "torch: DefaultLoadPlanner.load_bytes": "tests/unit/test_checkpoint_safety.py::"
    "test_pickle_in_a_dcp_value_is_refused_naming_its_file",
    "deepspeed: TorchCheckpointEngine.load": "tests/unit/test_checkpoint_safety.py::"
    "test_pickle_in_a_deepspeed_checkpoint_is_refused_by_resume_and_by_deepspeed",
}

# Private names of other packages that only `trainflow/compat/` may use.
PRIVATE_NAMES = (
    "_stop_workers",
    "get_method_name",
    "__compatible_ops__",
    "_SignalConnector",
    "_signal_connector",
    "_MODULES_TO_PACKAGES",
    "ray._private",
    "atexit._",
    "PREFECT__SERVER",
    "create_accelerator_and_postprocess",
    "_lazy_init",
    "_create_tcp_store_server",
    "c10d_rendezvous_backend.TCPStore",
    "_save_optimizer_and_scheduler",
)


def _ray_installed() -> bool:
    return patching.installed_version("ray") is not None


def _patches() -> list[patching.Patch]:
    return [p for p in PATCHES.values() if p.package != "ray" or _ray_installed()]


@pytest.mark.parametrize("patch", _patches(), ids=lambda p: p.name)
def test_each_patch_is_in_its_range_and_what_it_relies_on_is_there(patch):
    version = patching.installed_version(patch.package)
    assert patching.in_range(patch, version), (
        f"{patch.package} {version} is outside {patch.versions}: check the patch against "
        f"this version ({patch.why}), then widen its range"
    )
    assert patching.relies_on(patch) == []


def test_every_patch_names_the_test_of_what_it_fixes_and_that_test_exists():
    assert set(BEHAVIOUR) == set(PATCHES)
    for name, node in BEHAVIOUR.items():
        file, _, function = node.partition("::")
        tree = ast.parse((ROOT / file).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in defined, f"{name}: {node} does not exist"


def test_no_module_outside_compat_reaches_into_another_packages_private_names():
    offenders = []
    for folder in ("trainflow", "flows", "tasks"):
        for path in (ROOT / folder).rglob("*.py"):
            if "compat" in path.relative_to(ROOT).parts:
                continue
            text = path.read_text()
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in PRIVATE_NAMES if n in text]
    assert offenders == []


# --- the version check ---------------------------------------------------------------------


@pytest.fixture
def fresh(monkeypatch):
    """Patches declared for the test only, with no warning given yet."""
    monkeypatch.setattr(patching, "PATCHES", {})
    monkeypatch.setattr(patching, "_warned", set())
    return patching


def test_inside_its_range_a_patch_applies_without_a_word(fresh, monkeypatch):
    patch = fresh.declare("demo: Owner.run", "demo", ">=1.0,<2", target="json:dumps")
    monkeypatch.setattr(fresh, "installed_version", lambda package: "1.4.2+cpu")
    owner = type("Owner", (), {"run": staticmethod(lambda: "original")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.replace(patch, owner, "run", lambda original: lambda: "patched")
    assert owner.run() == "patched"


def test_outside_its_range_a_patch_warns_once_naming_package_version_and_patch(fresh, monkeypatch):
    patch = fresh.declare("demo: Owner.run", "demo", ">=1.0,<2", target="json:dumps")
    monkeypatch.setattr(fresh, "installed_version", lambda package: "2.1.0")
    owner = type("Owner", (), {"run": staticmethod(lambda: "original")})
    with pytest.warns(CompatWarning) as caught:
        fresh.replace(patch, owner, "run", lambda original: lambda: "patched")
        fresh.check(patch)
    (warning,) = caught
    assert "demo 2.1.0" in str(warning.message) and "'demo: Owner.run'" in str(warning.message)
    assert ">=1.0,<2" in str(warning.message)
    assert owner.run() == "patched"  # still there: applied, with the warning


def test_outside_its_range_a_patch_that_would_misbehave_silently_refuses(fresh, monkeypatch):
    patch = fresh.declare(
        "demo: Owner.run", "demo", ">=1.0,<2", target="json:dumps", outside="refuse"
    )
    monkeypatch.setattr(fresh, "installed_version", lambda package: "0.9")
    owner = type("Owner", (), {"run": staticmethod(lambda: "original")})
    with pytest.raises(CompatError, match=r"demo 0\.9 .*'demo: Owner\.run'.*>=1\.0,<2"):
        fresh.replace(patch, owner, "run", lambda original: lambda: "patched")
    assert owner.run() == "original"


def test_a_patch_whose_target_is_gone_is_skipped_with_a_warning(fresh, monkeypatch):
    patch = fresh.declare("demo: Owner.gone", "demo", ">=1.0,<2", target="json:no_such_thing")
    monkeypatch.setattr(fresh, "installed_version", lambda package: "1.0")
    assert fresh.relies_on(patch) == [
        "json:no_such_thing is gone (module 'json' has no attribute 'no_such_thing')"
    ]
    with pytest.warns(CompatWarning, match="gone; it is skipped"):
        assert not fresh.replace(patch, object, "gone", lambda original: original)


def test_a_changed_signature_is_named():
    patch = patching.Patch("demo", "demo", ">=1", target="json:dumps", params=("obj", "nope"))
    assert patching.relies_on(patch) == ["json:dumps takes no parameter 'nope'"]


# --- behaviour of the patches no other test covers ------------------------------------------


def test_rendezvous_events_are_named_from_the_frame_as_torch_names_them(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from trainflow.compat import torch as compat_torch

    original = dynamic_rendezvous.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", original)

    def recording_event() -> tuple[str, str]:
        expected = original(1)  # torch's own answer, from inspect.stack()
        return expected, dynamic_rendezvous.get_method_name(1)

    compat_torch.name_rendezvous_events_cheaply()
    assert dynamic_rendezvous.get_method_name is not original
    expected, got = recording_event()
    assert expected == got == "recording_event"


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
    )


def test_gpu_calls_on_a_cpu_rank_run_on_the_cpu(tmp_path):
    """`new_group(backend="nccl")` and `init_device_mesh("cuda")` on a CPU rank, in a process
    of its own (the patches are for ranks, not for this test process)."""
    out = _run(
        f"""
        import json, os
        from pathlib import Path
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
        from trainflow.compat import cpu_fallback
        cpu_fallback.install(Path({str(tmp_path)!r}), 0, "cpu", 600.0)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        group = dist.new_group(backend="nccl")
        mesh = init_device_mesh("cuda", (1,))
        print(json.dumps([dist.get_backend(group), mesh.device_type]))
        dist.destroy_process_group()
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == '["gloo", "cpu"]'
    made = (tmp_path / "adaptations" / "rank_0.json").read_text()
    assert "new_group(backend='nccl') runs with gloo" in made
    assert "init_device_mesh('cuda', ...) builds a CPU mesh" in made


def test_exit_now_runs_the_exit_handlers_and_keeps_the_code(tmp_path):
    out = _run(
        """
        import atexit
        from trainflow.compat.stdlib import exit_now
        atexit.register(print, "handler ran")
        exit_now(3)
        """,
        tmp_path,
    )
    assert out.returncode == 3 and out.stdout == "handler ran\n", out.stderr


def test_cleared_exit_handlers_do_not_run(tmp_path):
    out = _run(
        """
        import atexit
        from trainflow.compat.stdlib import clear_exit_handlers
        atexit.register(print, "inherited handler")
        clear_exit_handlers()
        atexit.register(print, "own handler")
        """,
        tmp_path,
    )
    assert out.returncode == 0 and out.stdout == "own handler\n", out.stderr


def test_no_compiled_ops_never_runs_deepspeeds_compiler_probe(tmp_path):
    """DeepSpeed probes every op (a compiler run each) on the first read of
    `ops.__compatible_ops__`; saying none is available must not read it first."""
    out = _run(
        """
        import subprocess
        import deepspeed
        from trainflow.compat.deepspeed import no_compiled_ops

        def refuse(*args, **kwargs):
            raise AssertionError(f"a process started: {args[0]!r}")

        subprocess.Popen.__init__ = refuse
        no_compiled_ops(deepspeed)
        print(deepspeed.ops.__compatible_ops__)
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "{}"  # DeepSpeed prints its accelerator first


UNWRAP = """
    import sys
    import torch
    from accelerate.utils import other
    from trainflow.compat.transformers import unwrap_without_deepspeed

    model = torch.nn.Linear(2, 2)
    if PATCHED:
        unwrap_without_deepspeed(other)
    assert other.extract_model_from_parallel(torch.nn.DataParallel(model)) is model
    print("deepspeed" in sys.modules)
    if PATCHED:
        import deepspeed  # a ZeRO run's ranks load it to build their engine

        print(other.is_deepspeed_available())
    """


def test_unwrapping_a_model_imports_deepspeed_only_where_it_is_loaded(tmp_path):
    """accelerate's unwrap (every Trainer save) imports DeepSpeed to test for its engine; with
    the patch a rank that never loaded DeepSpeed does not, and one that did still checks for
    the engine. Without the patch it does import it: the patch still has work to do."""
    pytest.importorskip("deepspeed")
    plain = _run("PATCHED = False\n" + textwrap.dedent(UNWRAP), tmp_path)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.splitlines()[-1] == "True"
    patched = _run("PATCHED = True\n" + textwrap.dedent(UNWRAP), tmp_path)
    assert patched.returncode == 0, patched.stderr[-2000:]
    # DeepSpeed prints its accelerator when imported: the first and last lines are ours.
    lines = patched.stdout.splitlines()
    assert (lines[0], lines[-1]) == ("False", "True")


def test_the_architecture_doc_lists_every_patch_with_its_range():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in doc.splitlines() if " | " in line}
    for patch in PATCHES.values():
        assert patch.name in rows, f"docs/architecture.md does not list {patch.name!r}"
        assert f"| {patch.versions} | {patch.outside} |" in rows[patch.name]


def test_a_cuda_probe_on_a_cpu_rank_fails_with_torchs_own_exception_class(monkeypatch):
    # A CPU build of torch raises AssertionError, a CUDA build without a device RuntimeError;
    # frameworks that probe CUDA (axolotl's peer-access check) catch the class they expect.
    from trainflow.compat.torch import explain_lazy_init

    monkeypatch.setenv("RANK", "1")

    def cpu_build() -> None:
        raise AssertionError("Torch not compiled with CUDA enabled")

    def no_driver() -> None:
        raise RuntimeError("Found no NVIDIA driver on your system.")

    with pytest.raises(AssertionError, match="rank 1 has no CUDA device") as cpu:
        explain_lazy_init(cpu_build)()
    assert "not compiled" in str(cpu.value.__cause__)
    with pytest.raises(RuntimeError, match="rank 1 has no CUDA device") as gpu:
        explain_lazy_init(no_driver)()
    assert not isinstance(gpu.value, AssertionError)
