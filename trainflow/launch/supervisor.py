"""Watching one local launch's agent until it ends: stream the rank logs, stop the launch on a
timeout, a hang, a stop file or a failure that lingers, and stop it gracefully when the caller
is interrupted."""

import contextlib
import os
import pickle
import signal
import subprocess
import time

from trainflow.errors import HangError, LaunchError, StopRequested
from trainflow.launch.diagnosis import PREEMPTED_TYPE, Watchdog, first_failure, read_errors
from trainflow.launch.failures import (
    LaunchCase,
    hang_error,
    peers_of_a_collective_abort,
    peers_that_stopped_answering,
    timeout_error,
)
from trainflow.launch.logs import LogTail
from trainflow.launch.processes import (
    dead_ranks,
    kill_process_group,
    kill_ranks,
    live_ranks,
    stop_process_group,
)
from trainflow.launch.spec import SHUTDOWN_GRACE_S

# How long the agent gets to end after a rank failed without restarts, before the launch
# stops it: enough to record the failure, not torch's 30 s wait on survivors.
FAILURE_GRACE_S = 5.0
# A rank that died without a Python error (a signal, the OOM killer) leaves no error record;
# after this long its survivors are killed so that the agent notices.
LOST_RANK_GRACE_S = 1.0
# How often the run folder is read for deaths, heartbeats and the stop file.
WATCH_EVERY_S = 0.25
# How often the launch is looked at: right after rank output, and at most while none comes.
POLL_S = 0.05
QUIET_POLL_S = 0.2


class Supervisor:
    """One local launch, from its agent's start to its end; `run` returns what to raise."""

    def __init__(self, case: LaunchCase, proc: subprocess.Popen, tail: LogTail):
        self.case = case
        self.proc = proc
        self.pgid = proc.pid  # the agent leads its own session, ranks included
        self.tail = tail
        self.failed_at: float | None = None  # first sign of a failed rank: an error, a death
        self.errors_seen = False
        self.survivors_killed = False
        self.grace = FAILURE_GRACE_S
        self.restarted_after = -1  # the last attempt whose survivors were stopped

    def run(self) -> LaunchError | None:
        """Supervise until every process is stopped; the error to raise, if the launch's
        outcome is not told by its ranks' results and errors."""
        verdict: LaunchError | None = None
        try:
            verdict = self._watch()
        except BaseException:
            self.stop_gracefully()
            raise
        finally:
            # Hung ranks cannot act on SIGTERM: no grace for them.
            grace = 0.0 if isinstance(verdict, HangError) else SHUTDOWN_GRACE_S
            stop_process_group(self.pgid, grace)
            self.proc.wait()
        self.tail.poll(final=True)
        return verdict

    def stop_gracefully(self) -> None:
        """The caller was interrupted: SIGTERM the launch, wait up to `stop_grace`, then kill.

        Ranks only note the SIGTERM; at the end of their step `runtime.should_stop()` says so
        on every rank, and they write a final checkpoint and end. The agent, stopped by the
        same signal, waits as long for them (its `shutdown_timeout`). The wait ends early once
        no rank still runs its function: a rank that has returned only waits for the agent to
        collect its value, which a stopping agent never does. A second Ctrl-C ends it at once.
        Ranks that never asked `should_stop()` cannot act on the request: they get the short
        `SHUTDOWN_GRACE_S` instead.
        """
        try:
            os.killpg(self.pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        grace = self.case.options.stop_grace
        if not self._ranks_check_stops():
            grace = min(grace, SHUTDOWN_GRACE_S)
        deadline = time.monotonic() + grace
        try:
            while time.monotonic() < deadline and self._ranks_working():
                self.tail.poll()
                time.sleep(0.1)
            self.tail.poll()
        except KeyboardInterrupt:
            pass  # asked twice: stop waiting
        finally:
            kill_process_group(self.pgid)

    def _ranks_check_stops(self) -> bool:
        """Whether a rank of the latest attempt has asked `runtime.should_stop()`."""
        rd = self.case.rd
        attempt = max((p["attempt"] for p in rd.rank_processes().values()), default=0)
        return any(c["attempt"] == attempt for c in rd.stop_checks().values())

    def _ranks_working(self) -> bool:
        """Whether a rank of the latest attempt still runs its function."""
        rd = self.case.rd
        finished = {**rd.result_files(), **rd.error_files()}
        for rank in live_ranks(rd, self.pgid):
            try:
                started = (rd.ranks / f"rank_{rank}.pid").stat().st_mtime_ns
                # An earlier attempt's error record does not count.
                if finished[rank].stat().st_mtime_ns < started:
                    return True
            except (KeyError, FileNotFoundError):
                return True
        return False

    def _watch(self) -> LaunchError | None:
        """Stream logs until the agent exits; stop on timeout, a hang or a lingering failure."""
        opts, rd = self.case.options, self.case.rd
        deadline = time.monotonic() + opts.timeout if opts.timeout else None
        watchdog = (
            Watchdog(rd, opts.hang_timeout, self.case.res.nproc_per_node)
            if opts.hang_timeout
            else None
        )
        next_watch = 0.0
        pause = POLL_S
        try:
            while self.proc.poll() is None:
                # Right after output, look again soon; while the ranks are quiet, less often
                # (this loop shares the cores the ranks train on).
                pause = POLL_S if self.tail.poll() else min(pause * 2, QUIET_POLL_S)
                now = time.monotonic()
                watch = now >= next_watch
                if watch:
                    next_watch = now + WATCH_EVERY_S
                done, verdict = self._check(now, watch, deadline, watchdog)
                if done:
                    return verdict
                time.sleep(pause)
            return None
        finally:
            self.tail.poll()

    def _check(
        self, now: float, watch: bool, deadline: float | None, watchdog: Watchdog | None
    ) -> tuple[bool, LaunchError | None]:
        """One look at the launch: (whether to stop watching, the error to raise)."""
        opts = self.case.options
        # With restarts allowed, a failed attempt is the elastic agent's call to make; only
        # its survivors are stopped, so that it restarts at once.
        if opts.max_restarts > 0 and watch:
            self.restarted_after = self._stop_failed_attempt()
        if opts.max_restarts == 0:
            silent = self._follow_failure(now, watch)
            if silent is not None:
                return True, silent
        if self.failed_at is not None and now - self.failed_at > self.grace:
            return True, None
        if deadline is not None and now > deadline:
            return True, timeout_error(self.case)
        if watchdog is not None and self.failed_at is None and watch and watchdog.stalled(now):
            return True, hang_error(self.case, self.pgid, watchdog)
        if opts.stop_file and watch and os.path.exists(opts.stop_file):
            self.stop_gracefully()
            return True, StopRequested(
                f"stopped on request ({opts.stop_file} appeared); the ranks "
                f"checkpointed at the step they reached. Rank logs: {self.case.rd.logs}",
                log_dir=str(self.case.rd.logs),
            )
        return False, None

    def _follow_failure(self, now: float, watch: bool) -> HangError | None:
        """Without restarts: notice a failed rank, and blame peers that stopped answering."""
        rd = self.case.rd
        if not self.errors_seen and rd.error_files():
            self.errors_seen = True
            self.failed_at = self.failed_at or now
            silent = peers_that_stopped_answering(self.case, self.pgid)
            if silent is not None:
                return silent
            self.grace = self._after_rank_error()
        elif self.failed_at is None and watch and (dead := dead_ranks(rd, self.pgid)):
            self.failed_at = now
            return peers_of_a_collective_abort(self.case, self.pgid, dead)
        elif (
            self.failed_at is not None
            and not self.errors_seen
            and not self.survivors_killed
            and now - self.failed_at > LOST_RANK_GRACE_S
        ):
            kill_ranks(rd, self.pgid)  # a rank died without a Python error
            self.survivors_killed = True
        return None

    def _after_rank_error(self) -> float:
        """A rank raised: stop the others now; return how long the agent then gets to end.

        Torch stops the surviving workers with SIGTERM and waits 30 s for them to exit; our
        ranks only note a SIGTERM, and survivors of a failure never reach the end of their
        step, so they are killed here, as that SIGTERM used to do. Unless the rank stopped on
        request (`Preempted`): its peers are finishing the same final checkpoint and get
        `stop_grace`.
        """
        errors = read_errors(self.case.rd)
        if errors[first_failure(errors)]["type"] == PREEMPTED_TYPE:
            return max(FAILURE_GRACE_S, self.case.options.stop_grace)
        kill_ranks(self.case.rd, self.pgid)
        return FAILURE_GRACE_S

    def _stop_failed_attempt(self) -> int:
        """With restarts: once a rank of the current attempt failed, kill the others.

        What `_after_rank_error` does without restarts, for the elastic agent, which waits
        30 s on survivors before it restarts. Returns the attempt now handled.
        """
        rd, stopped = self.case.rd, self.restarted_after
        procs = rd.rank_processes()
        attempt = max((p["attempt"] for p in procs.values()), default=0)
        if attempt == stopped:
            return stopped
        started = {}
        for rank, rec in procs.items():
            if rec["attempt"] == attempt:
                with contextlib.suppress(FileNotFoundError):
                    started[rank] = (rd.ranks / f"rank_{rank}.pid").stat().st_mtime_ns
        errors = {}
        for rank, path in rd.error_files().items():
            with contextlib.suppress(FileNotFoundError, EOFError, pickle.UnpicklingError):
                if rank in started and path.stat().st_mtime_ns >= started[rank]:
                    errors[rank] = pickle.loads(path.read_bytes())
        if errors:
            if errors[first_failure(errors)]["type"] == PREEMPTED_TYPE:
                return stopped  # the others are finishing the same final checkpoint
        elif not dead_ranks(rd, self.pgid):
            return stopped
        kill_ranks(rd, self.pgid, attempt)
        return attempt
