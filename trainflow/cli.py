"""Command lines generated from the same pydantic configs the Prefect UI shows as forms.

Every field becomes an option (`num_epochs` -> `--num-epochs`, nested `data.path` ->
`--data-path`) with the field's description as help, so `--help` documents every option and
the command line, the UI and deployments validate input in one place.
"""

import argparse
import contextlib
import gc
import json
import signal
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NoReturn, TypeVar, get_args, get_origin

from pydantic import BaseModel, ValidationError

from trainflow.compat import stdlib
from trainflow.launch.standby import AgentAhead, discard_standbys

M = TypeVar("M", bound=BaseModel)

# Whether `pause_collector` turned the cyclic collector off for this command's start-up.
_collector_paused = False


def pause_collector() -> None:
    """Turn the cyclic collector off for a pipeline command's start-up, until `run_pipeline`
    starts the flow (`python -m flows.NAME` calls it first thing, `flows/__init__.py`).

    A command's start-up is mostly imports (Prefect, MLflow, pydantic, matplotlib), during
    which the collector's full collections of a growing heap free next to nothing: without
    them they take about a fifth less CPU, beside the launch agent's imports on the way to
    the first step. The flow itself runs with the collector on.
    """
    global _collector_paused
    gc.disable()
    _collector_paused = True


def _resume_collector() -> None:
    global _collector_paused
    if _collector_paused:
        _collector_paused = False
        gc.enable()


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); constraints (`Annotated[str, ...]`) are the model's to check."""
    optional = False
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            annotation, optional = args[0], len(args) != len(get_args(annotation))
    if get_origin(annotation) is typing.Annotated:
        annotation = get_args(annotation)[0]
    return annotation, optional


def _add_fields(
    parser: argparse.ArgumentParser, model: type[BaseModel], defaults: BaseModel, prefix: str
) -> None:
    for name, info in model.model_fields.items():
        annotation, optional = _strip_optional(info.annotation)
        default = getattr(defaults, name)
        dest = f"{prefix}{name}"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and default:
            _add_fields(parser, annotation, default, f"{dest}.")
            continue
        flag = "--" + dest.replace(".", "-").replace("_", "-")
        help_text = (info.description or "").replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS}
        variants = _union_variants(info)
        if variants:
            names = ", ".join(variants)
            kwargs.update(type=_variant_value(info.discriminator), metavar="NAME|JSON")
            help_text += f" One of: {names}; or a JSON object with the variant's options."
            shown = getattr(default, str(info.discriminator), default)
            parser.add_argument(flag, help=f"{help_text} (default: {shown})", **kwargs)
            continue
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(annotation) is Literal:
            kwargs["choices"] = list(get_args(annotation))
            kwargs["type"] = type(get_args(annotation)[0])
        elif annotation in (int, float):
            kwargs["type"] = annotation
            kwargs["metavar"] = annotation.__name__.upper()
        elif annotation is str:
            kwargs["metavar"] = "TEXT"
        else:
            kwargs["type"] = json.loads
            kwargs["metavar"] = "JSON"
        shown = "none" if default is None else default
        if optional:
            help_text += " Pass 'none' to unset."
        parser.add_argument(flag, help=f"{help_text} (default: {shown})", **kwargs)


def _union_variants(info: Any) -> list[str]:
    """Variant names of a discriminated union field (`DDPConfig | FSDPConfig`), else []."""
    if not isinstance(info.discriminator, str):
        return []
    names: list[str] = []
    for arg in get_args(info.annotation):
        if not (isinstance(arg, type) and issubclass(arg, BaseModel)):
            return []
        literal = arg.model_fields[info.discriminator].annotation
        names.extend(str(v) for v in get_args(literal))
    return names


def _variant_value(discriminator: Any) -> Any:
    """`NAME` -> `{discriminator: NAME}`; a JSON object is taken as it is."""

    def parse(text: str) -> dict[str, Any]:
        if text.lstrip().startswith("{"):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise argparse.ArgumentTypeError("expected a JSON object")
            return value
        return {discriminator: text}

    return parse


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = nested
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = None if isinstance(value, str) and value.lower() == "none" else value
    return nested


def merge_options(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`base` (a config as a dict) with `update`'s options over it, nested sections merged."""
    out = dict(base)
    for key, value in update.items():
        old = out.get(key)
        # Switching a union's variant (e.g. technique fsdp -> ddp) replaces its options.
        switched = (
            isinstance(value, dict)
            and isinstance(old, dict)
            and "name" in value
            and value["name"] != old.get("name")
        )
        if isinstance(value, dict) and isinstance(old, dict) and not switched:
            out[key] = merge_options(old, value)
        else:
            out[key] = value
    return out


def build_parser(
    model: type[M], defaults: M, prog: str, description: str
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_fields(parser, model, defaults, "")
    return parser


def parse_config(
    model: type[M],
    defaults: M,
    argv: list[str] | None,
    prog: str,
    description: str,
    presets: Mapping[str, Callable[[], M]] | None = None,
    resumed: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None,
) -> M:
    """Parse `argv` into a validated `model`, starting from `defaults` (`parse_command_line`
    without switches)."""
    return parse_command_line(model, defaults, argv, prog, description, presets, resumed)[0]


def parse_command_line(
    model: type[M],
    defaults: M,
    argv: list[str] | None,
    prog: str,
    description: str,
    presets: Mapping[str, Callable[[], M]] | None = None,
    resumed: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None,
    switches: Mapping[str, str] | None = None,
) -> tuple[M, set[str]]:
    """Parse `argv` into a validated `model`, starting from `defaults`, and the switches given.

    `--config FILE` (YAML or JSON) starts from a whole config in a file instead; with
    `presets`, so does `--preset NAME`; with `resumed` (run id, the options given -> that run's
    saved config), so does `--resume RUN_ID`. The other options override the starting values.
    `switches` (`--name` -> help) are on/off options that are not part of the config
    (`--dry-run`); the ones given are returned beside it.
    Invalid values exit with status 2 and a message naming the option (or the file), like any
    argparse error.
    """
    parser = build_parser(model, defaults, prog, description)
    for switch, help_text in (switches or {}).items():
        parser.add_argument(switch, action="store_true", default=argparse.SUPPRESS, help=help_text)
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="Start from the config in this YAML or JSON file; the other options override it.",
    )
    if presets:
        start.add_argument(
            "--preset",
            choices=sorted(presets),
            default=argparse.SUPPRESS,
            help="Start from this shipped preset; the other options override its values "
            "(defaults shown here are the default preset's).",
        )
    given = vars(parser.parse_args(argv))
    on = {s for s in switches or {} if given.pop(s.lstrip("-").replace("-", "_"), False)}
    base = defaults.model_dump()
    if presets and "preset" in given:
        base = presets[given.pop("preset")]().model_dump()
    if "config" in given:
        base = _read_config_file(parser, given.pop("config"))
    if resumed is not None and given.get("resume"):
        if base != defaults.model_dump():
            parser.error("--resume starts from the run's own config: drop --config/--preset")
        try:
            base = resumed(given["resume"], _nest(given))
        except ValueError as exc:  # one line: the usage says nothing about which runs exist
            print(f"{prog}: error: --resume {given['resume']}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    merged = merge_options(base, _nest(given))
    try:
        return model.model_validate(merged), on
    except ValidationError as exc:
        flags = set(parser._option_string_actions)
        parser.error("; ".join(_problem(err, flags) for err in exc.errors()))
        raise  # unreachable: parser.error exits


def _problem(err: Any, flags: set[str]) -> str:
    """One validation error as `--option: what is wrong`, named as the user typed it.

    The error's location is a field path (`training.optimizer.learning_rate`); the option is
    its longest prefix that is a flag, and the rest (a key inside a JSON option such as
    `--technique`, with the union's tag) is named after it.
    """
    loc = [str(p) for p in err["loc"]]
    msg = str(err["msg"]).removeprefix("Value error, ")  # a validator's own message
    if not loc:
        return msg  # the config's own cross-field check, whose message names its fields
    dotted = ".".join(loc)
    if err["type"] == "extra_forbidden":  # a key in a --config file or a JSON option
        return f"{dotted!r} is not an option of this pipeline (see --help)"
    if len(loc) == 1 and err["type"] == "value_error" and _flag(loc[0]) not in flags:
        return msg  # a nested model's check, whose message names its fields itself
    for end in range(len(loc), 0, -1):
        flag = "--" + "-".join(loc[:end]).replace("_", "-")
        if flag in flags:
            rest = ".".join(loc[end:])
            return f"{flag}: {rest + ': ' if rest else ''}{msg}"
    return f"{dotted}: {msg}"


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _read_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The mapping in a YAML (or JSON) file; exits naming the file when it is not one."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        parser.error(f"--config {path}: cannot read it ({exc.strerror})")
    except yaml.YAMLError as exc:
        parser.error(f"--config {path}: not valid YAML or JSON: {exc}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of options, got {type(data).__name__}")
    return data


def pipeline_config(
    flow: Any,
    defaults: M,
    argv: list[str] | None,
    doc: str | None,
    presets: Mapping[str, Callable[[], M]] | None = None,
) -> M:
    """The command line of pipeline `flow` (`python -m flows.<name>`) as a validated config.

    `--resume RUN_ID` starts from the config that run was started with.
    """
    return _command_line_config(flow.name, defaults, argv, doc, presets)[0]


DRY_RUN_HELP = (
    "Plan the run without starting it: check the config, files and names, estimate memory "
    "per GPU, print placement, data, checkpoints and where it would run; exit 0 if it would "
    "fit, 1 naming what does not. Needs neither the GPUs nor the network."
)


def _command_line_config(
    name: str,
    defaults: M,
    argv: list[str] | None,
    doc: str | None,
    presets: Mapping[str, Callable[[], M]] | None,
    switches: Mapping[str, str] | None = None,
) -> tuple[M, set[str]]:
    from trainflow.storage import read_run_config

    resumable = "resume" in type(defaults).model_fields
    return parse_command_line(
        type(defaults),
        defaults,
        argv,
        prog=f"python -m flows.{name}",
        description=doc or "",
        presets=presets,
        resumed=(
            (lambda run_id, given: read_run_config(name, run_id, given.get("output_root")))
            if resumable
            else None
        ),
        switches=switches,
    )


def start_ahead(
    name: str,
    defaults: M,
    argv: list[str],
    presets: Mapping[str, Callable[[], M]] | None,
    check: Callable[[Any], None] | None,
    ahead: Callable[[M], Any],
) -> None:
    """`python -m flows.<name>`, before the flow's module imports Prefect (about a second of one
    core, while the other has nothing to do): if the command line is valid, its files check
    out (`check`), this machine can run it and a `--resume` would be accepted, call
    `ahead(config)`, which starts the run's
    training launch agent (`start_launch_agent`), whose imports come first on the way to the
    first step.

    Quiet: whatever is wrong is left for `run_pipeline`, which reads the same command line
    again and says so. The agent is the one its launch then uses; if none does, it is stopped
    when the pipeline ends, or when this process does.
    """
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            config = _command_line_config(name, defaults, argv, None, presets)[0]
            _check_machine(name, config)
            check_resume(name, config)  # a refused resume starts nothing
            if check is not None:
                check(config)
    except (SystemExit, Exception):  # a usage error, --help: `run_pipeline` reports it
        return
    ahead(config)


def refuse_resume_ahead(
    name: str, defaults: M, argv: list[str], presets: Mapping[str, Callable[[], M]] | None
) -> None:
    """`python -m flows.<name> --resume RUN_ID`, before the flow's module imports Prefect: a
    resume `check_resume` refuses exits 2 here, in one line, in about a second. Any other
    problem of the command line is left for `run_pipeline`, which reads it again."""
    import io

    if not any(arg == "--resume" or arg.startswith("--resume=") for arg in argv):
        return
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            config = _command_line_config(name, defaults, argv, None, presets)[0]
    except SystemExit:
        if ": error: --resume " in err.getvalue():  # no such run of this pipeline here
            sys.stderr.write(err.getvalue())
            raise
        return  # another usage error, --help: `run_pipeline` reports it
    except Exception:
        return
    try:
        check_resume(name, config)
    except ValueError as exc:
        print(f"python -m flows.{name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


class Terminated(BaseException):
    """SIGTERM arrived: stop the pipeline as Ctrl-C would (the run ends KILLED).

    A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it.
    """

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signal = signum


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _sigterm_stops() -> Iterator[None]:
    """SIGTERM raises `Terminated` instead of killing the process on the spot.

    A flow run installs its own handler (raising Prefect's `TerminationSignal`) and, once the
    flow has recorded how it ended, sends the signal again to the handler it found: this one,
    so the command line can still report and exit 143 instead of dying silently.
    """
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_reason(exc: BaseException) -> tuple[str, int] | None:
    """(what stopped the pipeline, exit status) for Ctrl-C and SIGTERM, else None."""
    if isinstance(exc, KeyboardInterrupt):
        return "Ctrl-C (SIGINT)", 128 + signal.SIGINT
    if isinstance(exc, Terminated) or type(exc).__name__ == "TerminationSignal":
        signum = int(getattr(exc, "signal", signal.SIGTERM))
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return name, 128 + signum
    return None


def _report_stop(flow: Any, reason: str, run_id: str | None) -> None:
    from trainflow import tracking

    prefix = f"stopped: {reason}"
    if run_id is None:
        print(f"{prefix}; no MLflow run had started.", file=sys.stderr)
        return
    try:
        status = tracking.run_status(run_id)
    except Exception:  # the store cannot be read: say what was meant to happen
        status = "KILLED"
    line = f"{prefix}; MLflow run {run_id} is {status}."
    if status != "FINISHED":
        line += f" Continue it with: python -m flows.{flow.name} --resume {run_id}"
    print(line, file=sys.stderr)


def run_pipeline(
    flow: Any,
    defaults: M,
    argv: list[str] | None,
    doc: str | None,
    presets: Mapping[str, Callable[[], M]] | None = None,
    summary_metrics: list[str] | None = None,
    server: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    check: Callable[[Any], None] | None = None,
    deep_check: Callable[[Any], None] | None = None,
    dry_run: Callable[[Any], bool] | None = None,
) -> Any:
    """`python -m flows.<name>`: parse the command line, run the flow, print where things are.

    Ctrl-C or SIGTERM ends the MLflow run KILLED and exits 130 or 143 with one line saying
    so (and how to continue the run), not a traceback; bad data found once it is read exits 1
    with one line naming the file.

    Args:
        flow: The pipeline's flow; it takes the config and returns a `PipelineResult`.
        defaults: The config the options start from.
        argv: Command-line arguments (None: `sys.argv[1:]`).
        doc: The flow module's docstring, shown by `--help`.
        presets: `--preset NAME` choices, each giving a starting config.
        summary_metrics: Metrics to print at the end, in order (None: all).
        server: Context around the flow run, entered only once the command line is valid and
            the machine can run it; it yields a call that returns once the server is ready
            (the flows pass a starting temporary Prefect server here; this module never
            imports Prefect).
        check: The workload's own config check (bad files, names the ranks would fail on),
            run before the server starts; a `ValueError` from it is a usage error.
        deep_check: A check that needs the workload's libraries (seconds of imports): it
            runs while the server starts, which it stops on a usage error.
        dry_run: With it, `--dry-run` plans the run instead: it prints the plan and returns
            whether the run would fit (exit 0, else 1); nothing starts.
    """
    from trainflow import tracking
    from trainflow.data.errors import DataError

    switches = {"--dry-run": DRY_RUN_HELP} if dry_run else None
    config, on = _command_line_config(flow.name, defaults, argv, doc, presets, switches)
    if dry_run is not None and "--dry-run" in on:
        raise SystemExit(0 if dry_run(config) else 1)
    _check_machine(flow.name, config)
    _usage_check(flow, lambda c: check_resume(flow.name, c), config)
    _usage_check(flow, check, config)
    before = tracking.last_run_id()
    around = server() if server else contextlib.nullcontext(lambda: None)
    try:
        with _sigterm_stops(), around as server_ready:
            _usage_check(flow, deep_check, config)
            server_ready()
            _resume_collector()
            result = flow(config)
    except DataError as exc:  # found once the data was read: say which file, no traceback
        print(f"python -m flows.{flow.name}: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except BaseException as exc:
        stop = _stop_reason(exc)
        if stop is None:
            raise
        reason, code = stop
        run_id = tracking.last_run_id()
        _report_stop(flow, reason, run_id if run_id != before else None)
        raise SystemExit(code) from None
    finally:
        discard_standbys()  # an agent started ahead that no launch used
    _print_result(flow, result, summary_metrics)
    return result


def preload(*modules: str, launch_module: str | None = None) -> Callable[[Any], None]:
    """A `deep_check` that imports `modules`: what the run needs, loaded while the server starts.

    With `launch_module` (the workload's module), the training launch's agent starts first and
    imports it meanwhile (`start_launch_agent`).
    """

    def load(config: Any) -> None:
        import importlib

        if launch_module is not None:
            start_launch_agent(config, launch_module)
        for name in modules:
            importlib.import_module(name)

    return load


# What a technique's ranks import besides the workload, loaded once in the launch's agent
# before they fork rather than in each rank. DeepSpeed only where it trains: about 0.6 s of a
# core, and DDP and FSDP ranks never load it (`compat.transformers.unwrap_without_deepspeed`).
TECHNIQUE_IMPORTS: dict[str | None, tuple[str, ...]] = {"deepspeed": ("deepspeed",)}


def start_launch_agent(
    config: Any,
    module: str,
    check: tuple[str, Any] | None = None,
    then: Sequence[tuple[str, Any]] = (),
) -> AgentAhead:
    """Start the agent of the run's training launch now (`trainflow.launch.backends.standby`),
    importing the workload's `module` and what the config's technique needs besides
    (`TECHNIQUE_IMPORTS`): ranks then start with them loaded. Not for runs that wait for rank
    slots (a sweep's trials). Returns the call that stops it if no launch used it;
    `run_pipeline` also stops it if the run never launches. `check` (`module:function`, a JSON
    value) runs in the agent first (`AgentAhead.check_outcome`), then the calls in `then`
    (`AgentAhead.outcome`), before it imports the rest."""
    from trainflow.launch.backends import standby
    from trainflow.resources import Resources

    if not isinstance(config, Resources) or getattr(config, "gpu_pool", None) is not None:
        return AgentAhead()
    technique = getattr(getattr(config, "technique", None), "name", None)
    preload = [module, *TECHNIQUE_IMPORTS.get(technique, ())]
    return standby(config.launch_options(), preload, check, then)


def check_resume(name: str, config: Any) -> None:
    """With `--resume RUN_ID`, refuse in a second, before any server or run starts, what the
    run would refuse once started: the run's config changed (`check_resume_config`), or its
    MLflow run missing, deleted, in another experiment, FINISHED or still running here
    (`tracking.check_resumable`).

    Raises:
        ValueError: naming the run and why it cannot be continued.
    """
    from trainflow import tracking
    from trainflow.configs.base import check_resume_config

    run_id = getattr(config, "resume", None)
    if not run_id:
        return
    if hasattr(config, "training_fields"):
        check_resume_config(name, config, run_id)
    tracking.check_resumable(run_id, getattr(config, "experiment_name", None))


def _usage_check(flow: Any, check: Callable[[Any], None] | None, config: Any) -> None:
    """Run `check`; a `ValueError` from it exits as a usage error naming the pipeline."""
    if check is None:
        return
    try:
        check(config)
    except ValueError as exc:
        print(f"python -m flows.{flow.name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _print_result(flow: Any, result: Any, summary_metrics: list[str] | None) -> None:
    if result.model_version is None:
        model = "not registered (gate failed)"
    else:
        model = f"{result.registered_model_name} version {result.model_version}"
        if result.alias:
            model += f", {result.alias}"
        elif not result.champion:
            model += ", no alias (gate not passed)"
    metrics = result.metrics
    shown = summary_metrics if summary_metrics is not None else list(metrics)
    print_summary(
        f"{flow.name} pipeline finished",
        {
            "MLflow store": result.tracking_uri,
            "MLflow run": result.mlflow_run_id,
            "Technique": result.technique,
            "Model": model,
        },
        {k: metrics[k] for k in shown if k in metrics},
    )


def _check_machine(name: str, config: BaseModel) -> None:
    """Exit as a usage error, before anything starts, if this machine cannot run the ranks.

    A GPU type or count the machine does not have fails here in a second, before the local
    Prefect server starts or an MLflow run exists.
    """
    from trainflow.launch.plan import ResourceError, check_cpu_oversubscription
    from trainflow.resources import Resources

    if not isinstance(config, Resources):
        return
    try:
        check_cpu_oversubscription(config.launch_plan())
    except ResourceError as exc:
        print(f"python -m flows.{name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def print_summary(title: str, rows: dict[str, str], metrics: dict[str, float]) -> None:
    """The block a pipeline prints when it ends: where things are, then its metrics."""
    width = max(len(k) for k in [*rows, *metrics])
    print(f"\n=== {title} ===")
    for key, value in rows.items():
        print(f"{key:<{width}} : {value}")
    for key, number in metrics.items():
        print(f"{key:<{width}} : {number:.4f}")


def exit_now(code: int = 0) -> NoReturn:
    """End a `python -m flows.NAME` process once its pipeline has returned.

    The exit handlers run (Prefect's and MLflow's last flushes, logging's shutdown), the
    streams are flushed, and the process exits without the interpreter's teardown of every
    loaded module, which takes about 2 s with torch, transformers and Prefect loaded and
    serves no one: the run's files, databases and server are already closed.
    """
    stdlib.exit_now(code)
