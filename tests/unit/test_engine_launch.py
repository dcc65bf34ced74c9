"""The launcher's child processes leave nothing behind when stopped, and keep the evidence when they die."""

from __future__ import annotations

import sys

from slimeflow.engine.launch import _ManagedProcess


def test_a_stopped_child_takes_its_log_along_and_a_dead_ones_log_stays():
    stopped = _ManagedProcess(["sleep", "30"], url="http://127.0.0.1:1")
    stopped_log = stopped.log_path
    assert stopped_log.exists()
    stopped.stop()
    assert stopped.process.returncode is not None and not stopped_log.exists()

    died = _ManagedProcess([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], url="http://127.0.0.1:1")
    report = died.exit_report(wait_s=30)
    died.stop()
    assert report is not None and "exited with code 3" in report and "boom" in report
    assert died.log_path.read_text().strip() == "boom"  # what the error names is still there to read
    died.log_path.unlink()
