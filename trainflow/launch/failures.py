"""A launch's failures, explained: which rank failed first and why, which peers stopped
answering (with their stacks), what timed out or hung. Each error names the ranks and points at
their logs."""

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from trainflow.errors import (
    HangError,
    LaunchError,
    LaunchTimeoutError,
    RankError,
    first_line,
    is_collective_failure,
)
from trainflow.launch.diagnosis import (
    COLLECTIVE_ABORT,
    Watchdog,
    collective_in,
    dump_stacks,
    first_failure,
    ranks_text,
    read_errors,
    resolve_traceback,
    shipped_cause,
    stacks_text,
)
from trainflow.launch.logs import tail
from trainflow.launch.plan import LaunchPlan
from trainflow.launch.processes import dead_ranks, live_ranks
from trainflow.launch.run_dir import RunDir
from trainflow.launch.ship import CodeSpan
from trainflow.launch.spec import LaunchOptions, LaunchResult


@dataclass
class LaunchCase:
    """What explaining a launch's outcome needs to know about it."""

    name: str
    options: LaunchOptions
    rd: RunDir
    res: LaunchPlan
    shipped: Sequence[CodeSpan] = ()
    # Ranks already gone when a peer failed in a collective: they, not it, were lost first.
    gone_at_failure: list[int] = field(default_factory=list)

    def traceback(self, rec: dict[str, Any]) -> str:
        return resolve_traceback(rec["traceback"], self.shipped).rstrip()


def expected_ranks(rd: RunDir, res: LaunchPlan) -> list[int]:
    """This node's ranks: all of them on one node, else those that wrote a log."""
    return list(range(res.nproc_per_node)) if res.nnodes == 1 else sorted(rd.log_files())


def timeout_error(case: LaunchCase) -> LaunchTimeoutError:
    """The launch ran past `timeout`: name the ranks still running."""
    rd, res = case.rd, case.res
    expected = expected_ranks(rd, res)
    results = rd.result_files()
    running = [r for r in expected if r not in results] or expected
    return LaunchTimeoutError(
        f"{case.name}.distributed() timed out after {case.options.timeout:g}s; "
        f"rank(s) {', '.join(map(str, running))} still running were stopped. "
        f"Rank logs: {rd.logs}",
        running_ranks=running,
        log_dir=str(rd.logs),
    )


def hang_error(case: LaunchCase, pgid: int, watchdog: Watchdog) -> HangError:
    """No rank advanced for `hang_timeout`: name every rank's last step, show the stacks.

    Ranks in step with each other wait for one another in a collective; a rank behind the
    others is the one they wait for, so its stack is the one shown.
    """
    rd = case.rd
    beats = dict(sorted(watchdog.beats.items()))
    steps: dict[int, int | None] = {r: b["step"] for r, b in beats.items()}
    low, high = min(beats[r]["step"] for r in beats), max(beats[r]["step"] for r in beats)
    stuck = [r for r in beats if beats[r]["step"] == low]
    live = live_ranks(rd, pgid)
    stacks = dump_stacks(rd, {r: live[r] for r in beats if r in live}, case.shipped)
    now = time.time()
    # Ranks waiting in a collective wait for the peers that are not in it: those are stuck.
    waiting = {r: c for r in beats if (c := collective_in(stacks.get(r, ""), newest_first=True))}
    if any(r not in waiting for r in stuck) and any(r in waiting for r in beats):
        stuck = [r for r in stuck if r not in waiting]
    waits = ""
    for rank, collective in waiting.items():
        if rank not in stuck:
            them = "it" if len(stuck) == 1 else "them"
            waits = (
                f"\n{ranks_text(stuck)} stopped answering: rank {rank} waited "
                f"{now - beats[rank]['time']:.0f}s for {them} in {collective}()."
            )
            break
    stacks = {r: dump for r, dump in stacks.items() if r in stuck or r in waiting}
    where = ", ".join(
        f"rank {r} at step {b['step']} (last beat {now - b['time']:.0f}s ago)"
        for r, b in beats.items()
    )
    behind = (
        f"\n{ranks_text(stuck)} fell behind at step {low} while others reached step "
        f"{high}: the others wait for {'it' if len(stuck) == 1 else 'them'}."
        if low != high
        else ""
    )
    return HangError(
        f"{case.name}.distributed() hung: no rank's heartbeat advanced for "
        f"{case.options.hang_timeout:g}s (hang_timeout); every rank was stopped. "
        f"Last steps: {where}.{waits}{behind}"
        + stacks_text(stacks, steps)
        + f"\n\nRank logs: {rd.logs}",
        stuck_ranks=stuck,
        last_steps=steps,
        log_dir=str(rd.logs),
    )


def peers_that_stopped_answering(case: LaunchCase, pgid: int) -> HangError | None:
    """A rank raised waiting for its peers: are some of them alive but silent?

    Those peers, not the rank that noticed, are where the launch is stuck: they get the
    blame and their stacks are dumped before anything is stopped. Peers already dead are
    noted for `collect`.
    """
    rd = case.rd
    errors = read_errors(rd)
    first = first_failure(errors)
    rec = errors[first]
    if not is_collective_failure(rec["type"], rec["message"]):
        return None
    case.gone_at_failure = dead_ranks(case.rd, pgid)
    error = _silent_peers_error(
        case,
        pgid,
        first,
        f"{rec['type_name']}: {first_line(rec['message'])}",
        f"Traceback from rank {first}:\n{case.traceback(rec)}",
    )
    if error is not None:
        error.__cause__ = shipped_cause(rec)
    return error


def peers_of_a_collective_abort(case: LaunchCase, pgid: int, dead: list[int]) -> HangError | None:
    """Ranks died without a Python error: did one abort on a collective timeout?

    NCCL's watchdog ends a rank whose collective timed out (SIGABRT), so no exception
    reaches the worker; the rank's log still has the watchdog's line.
    """
    rd = case.rd
    for rank in dead:
        lines = tail(rd.log_path(rank), 40).splitlines()
        line = next((x for x in reversed(lines) if COLLECTIVE_ABORT.search(x)), None)
        if line is not None:
            return _silent_peers_error(
                case,
                pgid,
                rank,
                line.strip(),
                f"Last lines of rank {rank}:\n" + "\n".join(lines[-15:]),
            )
    return None


def _silent_peers_error(
    case: LaunchCase, pgid: int, first: int, failure: str, evidence: str
) -> HangError | None:
    """Rank `first` failed in a collective with `failure`: blame the peers still alive."""
    rd = case.rd
    done = {*rd.result_files(), *rd.error_files(), first}
    silent = {r: pid for r, pid in live_ranks(rd, pgid).items() if r not in done}
    if not silent:
        return None
    stacks = dump_stacks(rd, silent, case.shipped)
    failed = set(rd.error_files())  # a peer may have failed on its own meanwhile
    stuck = sorted(r for r in silent if r not in failed)
    if not stuck:
        return None
    beats = rd.heartbeats()
    steps = {r: beats[r]["step"] if r in beats else None for r in stuck}
    them = "it" if len(stuck) == 1 else "them"
    # The collective rank `first` called (its traceback, or NCCL's line), not the transport's
    # own operation that timed out under it (gloo's "recv operation").
    collective = collective_in(evidence) or collective_in(failure)
    where = f"in {collective}()" if collective else "in a collective"
    if re.search(r"timed? ?out|timeout", failure, re.IGNORECASE):
        ms = re.search(r"Timeout\(ms\)=(\d+)|(\d+)\s*ms\b", failure)
        waited = (
            f"{int(ms[1] or ms[2]) / 1000:g}s" if ms else f"{case.options.collective_timeout:g}s"
        )
        how = f"rank {first} timed out after {waited} waiting for {them} {where}"
    else:
        how = f"rank {first} failed waiting for {them} {where}"
    return HangError(
        f"{ranks_text(stuck)} stopped answering: {how} ({failure}); every rank was stopped."
        + stacks_text(stacks, steps)
        + f"\n\n{evidence}"
        + f"\n\nRank logs: {rd.logs}",
        stuck_ranks=stuck,
        last_steps=steps,
        log_dir=str(rd.logs),
    )


def collect(case: LaunchCase, returncode: int) -> LaunchResult:
    """The launch's result once every process has ended, or the error that explains why not."""
    rd, res = case.rd, case.res
    log_dir = str(rd.logs)
    errors = read_errors(rd)
    results = rd.result_files()
    expected = expected_ranks(rd, res)
    missing = [r for r in expected if r not in results]
    if errors and (returncode != 0 or missing):
        gone = [r for r in case.gone_at_failure if r not in errors]
        if gone:
            raise _lost_peer_error(case, gone, errors)
        raise _rank_error(case, errors)
    if returncode != 0 or missing or not results:
        detail = rd.agent_error.read_text() if rd.agent_error.exists() else ""
        detail = detail or tail(rd.agent_log)
        logs = "\n".join(
            f"--- rank {r} (last lines) ---\n{tail(p, 15)}" for r, p in rd.log_files().items()
        )
        raise LaunchError(
            f"{case.name}.distributed() failed (agent exit code {returncode}); "
            f"rank(s) without a result: {missing or 'all'}.\n{detail}\n{logs}\n"
            f"Rank logs: {log_dir}",
            log_dir=log_dir,
        )
    values = [cloudpickle.loads(results[r].read_bytes()) for r in sorted(results)]
    return LaunchResult(values, rd.path, rd.log_files(), res, sorted(results))


def _lost_peer_error(case: LaunchCase, gone: list[int], errors: dict[int, dict]) -> LaunchError:
    """Peers died without a Python error, and a rank then failed in a collective.

    The agent's own summary would name that rank as the root cause: it saw its exit code
    first. The peers' processes were already gone when the rank failed.
    """
    log_dir = str(case.rd.logs)
    first = first_failure(errors)
    rec = errors[first]
    error = LaunchError(
        f"{ranks_text(gone)} died without a Python error (killed by a signal: SIGKILL, "
        f"the OOM killer, ...); rank {first} then failed in a collective with "
        f"{rec['type_name']}: {first_line(rec['message'])}"
        f"\n\nTraceback from rank {first}:\n{case.traceback(rec)}"
        f"\n\nRank logs: {log_dir}",
        log_dir=log_dir,
    )
    error.__cause__ = shipped_cause(rec)
    return error


def _rank_error(case: LaunchCase, errors: dict[int, dict]) -> RankError:
    log_dir = str(case.rd.logs)
    first = first_failure(errors)
    rec = errors[first]
    others = sorted(r for r in errors if r != first)
    message = (
        f"rank {first} failed while {rec['where']} with {rec['type_name']}: {rec['message']}"
        + (f"\n(failed after it: rank {', '.join(map(str, others))})" if others else "")
        + f"\n\nTraceback from rank {first}:\n{case.traceback(rec)}"
        + f"\n\nRank logs: {log_dir}"
    )
    error = RankError(
        message,
        rank=first,
        exc_type=rec["type"],
        remote_traceback=resolve_traceback(rec["traceback"], case.shipped),
        failed_ranks=sorted(errors),
        log_dir=log_dir,
        remote_message=rec["message"],
    )
    error.__cause__ = shipped_cause(rec)
    return error
