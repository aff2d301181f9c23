"""Errors raised by `trainflow.distributed` launches, and by a technique a framework cannot run.

No imports: the orchestrator raises these before any rank (or torch) starts.
"""


class FrameworkError(ValueError):
    """A technique cannot run under a framework (Hugging Face Trainer, Lightning, our loop).

    The message names both. `check_framework` raises it before launch; a strategy raises the
    same message if a rank asks it for a framework object it cannot build.
    """


class LaunchError(RuntimeError):
    """A distributed launch did not produce a result for every rank."""

    def __init__(self, message: str, log_dir: str | None = None):
        super().__init__(message)
        self.log_dir = log_dir


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
    ):
        super().__init__(message, log_dir)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.failed_ranks = failed_ranks


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The launch ran past its `timeout`; every process it started has been stopped."""

    def __init__(self, message: str, *, running_ranks: list[int], log_dir: str | None = None):
        super().__init__(message, log_dir)
        self.running_ranks = running_ranks
