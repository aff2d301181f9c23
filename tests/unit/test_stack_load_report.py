"""`benchmarks.stack_load` runs its processes in a work folder it deletes at the end: a process
that fails has the tail of its output shown on stderr, where the test that runs the load reads
it, instead of going with the folder."""

import os

from benchmarks.stack_load import LOG_TAIL, run_load


def test_a_failed_process_has_the_end_of_its_output_on_stderr(tmp_path, capsys):
    module = tmp_path / "fails.py"
    prints = [f"print('line {i}')" for i in range(LOG_TAIL + 20)]
    module.write_text("\n".join([*prints, "raise SystemExit('the reason it failed')"]) + "\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    result = run_load(env, tmp_path, {"fails": ["fails"], "passes": ["site"]})

    err = capsys.readouterr().err
    assert result["exit_codes"] == {"fails": 1, "passes": 0}
    assert "--- the last lines of fails's output ---" in err
    assert "the reason it failed" in err and f"line {LOG_TAIL + 19}\n" in err
    assert "line 0\n" not in err  # the tail only
    assert "passes's output" not in err
