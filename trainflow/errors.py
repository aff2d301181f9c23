"""Errors raised by `trainflow.distributed` launches, and by a technique a framework cannot run.

No imports: the orchestrator raises these before any rank (or torch) starts, and classifies
rank failures by the names of their exception types (strings), never by torch's classes.
"""

import re


class FrameworkError(ValueError):
    """A technique cannot run under a framework (Hugging Face Trainer, Lightning, our loop).

    The message names both. `check_framework` raises it before launch; a strategy raises the
    same message if a rank asks it for a framework object it cannot build.
    """


class SingleProcessFrameworkError(RuntimeError):
    """A framework (accelerate, Lightning, DeepSpeed) set itself up for fewer processes than the
    launch started, so each rank would train its own copy: raised on the rank, at set-up."""


class RemoteNotConfiguredError(ValueError):
    """`remote=True` was asked for, but no deployment is configured to run the call on."""


class LaunchError(RuntimeError):
    """A distributed launch did not produce a result for every rank."""

    def __init__(self, message: str, log_dir: str | None = None):
        super().__init__(message)
        self.log_dir = log_dir

    def __reduce__(self) -> tuple:
        # Pickle would call `cls(*args)`, which the subclasses' keyword-only fields refuse
        # (Prefect pickles task errors). Every field is a constructor argument of the same
        # name, so the fields are passed back by name. The cause (a rank's own exception)
        # travels too, pickled apart: one that cannot be pickled is left out, not the error.
        return (_rebuild_error, (type(self), self.args, self.__dict__, _pickled(self.__cause__)))


def _pickled(cause: BaseException | None) -> bytes | None:
    if cause is None:
        return None
    import cloudpickle  # only when an error is pickled: the module stays import-free

    try:
        return cloudpickle.dumps(cause)
    except Exception:
        return None


def _rebuild_error(
    cls: type[LaunchError], args: tuple, fields: dict, cause: bytes | None = None
) -> LaunchError:
    error = cls(*args, **fields)
    if cause is not None:
        import pickle

        try:
            error.__cause__ = pickle.loads(cause)
        except Exception:  # its class does not import here: the message still names it
            error.__cause__ = None
    return error


class LaunchConfigError(LaunchError, ValueError):
    """The launch cannot start as configured (environment, start method); nothing started."""


class PayloadError(LaunchError, TypeError):
    """The function or one of its arguments cannot be sent to the ranks (raised before launch)."""


class RankError(LaunchError):
    """A rank raised. Carries the first failing rank, its exception type and traceback.

    `__cause__` holds the rank's original exception when it could be shipped back.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exc_type: str,
        remote_traceback: str,
        failed_ranks: list[int],
        log_dir: str | None = None,
        remote_message: str = "",
    ):
        super().__init__(message, log_dir)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.failed_ranks = failed_ranks
        # The rank's own `str(exception)`, without the launcher's framing and traceback.
        self.remote_message = remote_message


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The launch ran past its `timeout`; every process it started has been stopped."""

    def __init__(self, message: str, *, running_ranks: list[int], log_dir: str | None = None):
        super().__init__(message, log_dir)
        self.running_ranks = running_ranks


class HangError(LaunchError):
    """Ranks stopped making progress; every process of the launch has been stopped.

    Raised when no rank's heartbeat advanced for `hang_timeout` seconds, or when a rank failed
    waiting for peers in a collective while those peers were still alive (they stopped
    answering). `stuck_ranks` are the ranks blamed: the silent peers, or the ranks at the
    lowest step (all of them when they agree). `last_steps` holds the last heartbeat step of
    the ranks named (None: the rank never called `runtime.heartbeat`). The message carries
    the stuck ranks' Python stacks, dumped just before they were stopped.
    """

    def __init__(
        self,
        message: str,
        *,
        stuck_ranks: list[int],
        last_steps: dict[int, int | None] | None = None,
        log_dir: str | None = None,
    ):
        super().__init__(message, log_dir)
        self.stuck_ranks = stuck_ranks
        self.last_steps = dict(last_steps or {})


class StopRequested(LaunchError):
    """The launch was asked to stop from outside its process: its stop file appeared.

    The ranks were stopped as on a preemption (a final checkpoint at the step they reached),
    but nobody wants the run continued by a retry: not transient. A sweep's pruner stops a
    trial this way; so can a person (`touch` the file named in `LaunchOptions.stop_file`).
    """


class Preempted(RuntimeError):
    """A rank stopped on request (SIGTERM: a preemption, Ctrl-C or a cancel upstream).

    Raised by a training loop after `runtime.should_stop()` said so and the final checkpoint
    was written, so that the launch fails as a transient error a relaunch resumes from.
    Either pass the message, or `rank` and `step` to have it written.
    """

    def __init__(
        self, message: str | None = None, *, rank: int | None = None, step: int | None = None
    ):
        if message is None:
            message = f"rank {rank} stopped on request after step {step}"
        super().__init__(message)
        self.rank = rank
        self.step = step


# Exceptions torch.distributed raises when a peer or the store is lost (all RuntimeErrors).
_TORCH_PEER_ERRORS = frozenset({"DistBackendError", "DistNetworkError", "DistStoreError"})
# A RuntimeError from a collective: the backend, a timeout, or the connection to a peer.
_COLLECTIVE_MESSAGE = re.compile(r"gloo|nccl|timed out|connection (closed|reset)", re.IGNORECASE)
# The narrower signs that a peer was lost, which a relaunch can fix.
_LOST_PEER_MESSAGE = re.compile(
    r"connection (closed|reset) by peer"
    r"|(gloo|nccl)[\s\S]*(timed out|timeout)|(timed out|timeout)[\s\S]*(gloo|nccl)",
    re.IGNORECASE,
)
_PREEMPTED = f"{Preempted.__module__}.{Preempted.__qualname__}"


def _is_torch_peer_error(exc_type: str) -> bool:
    module, _, name = exc_type.rpartition(".")
    return module.split(".")[0] == "torch" and name in _TORCH_PEER_ERRORS


def is_collective_failure(exc_type: str, message: str) -> bool:
    """Did a rank fail waiting on its peers (a collective, the store), by its exception?

    `exc_type` is the qualified name a `RankError` carries ("torch.distributed.DistBackendError",
    "builtins.RuntimeError"), `message` the exception's text.
    """
    if _is_torch_peer_error(exc_type):
        return True
    return exc_type == "builtins.RuntimeError" and bool(_COLLECTIVE_MESSAGE.search(message))


def is_transient(exc: BaseException) -> bool:
    """True for a failure a relaunch can fix; False for one it would only repeat.

    Transient: a timeout or a hang, a rank or the agent killed by a signal (SIGKILL, the OOM
    killer: a `LaunchError` without a Python error), a lost peer or store (torch's
    `DistBackendError`, `DistNetworkError`, `DistStoreError`, a connection closed or reset by
    the peer, a Gloo/NCCL timeout) and a preemption (`Preempted`). Not transient: an exception
    raised by the function itself, a bad configuration, resources that are not there, a
    function or argument that cannot be sent.
    """
    if isinstance(exc, StopRequested):
        return False
    if isinstance(exc, (LaunchTimeoutError, HangError, Preempted)):
        return True
    if isinstance(exc, RankError):
        if exc.exc_type == _PREEMPTED or _is_torch_peer_error(exc.exc_type):
            return True
        # Without the rank's own message, the launcher's first paragraph (before the traceback).
        text = exc.remote_message or str(exc).split("\n\n", 1)[0]
        return bool(_LOST_PEER_MESSAGE.search(text))
    if isinstance(exc, (PayloadError, LaunchConfigError)):
        return False
    return isinstance(exc, LaunchError)


def is_root_cause(exc: BaseException) -> bool:
    """A rank's own error, not one of waiting on a peer (across nodes, the cause to report)."""
    return isinstance(exc, RankError) and not is_collective_failure(
        exc.exc_type, exc.remote_message or ""
    )


def failure_rank(exc: BaseException) -> int:
    """How much an error says about a failure: 0 a rank's own error, 1 a rank's error waiting
    on a peer, 2 anything else (sort by it to report the first real cause)."""
    return 0 if is_root_cause(exc) else 1 if isinstance(exc, RankError) else 2


def first_line(text: str) -> str:
    """The first non-blank line of `text`, stripped."""
    return next((line for line in text.strip().splitlines() if line.strip()), text).strip()
