"""Last words on SIGTERM: a popen launcher that Lightning's child-process observer is about
to SIGKILL names the cause first, and a clean-up SIGTERM to a rank that already reported its root
cause repeats that cause instead of becoming the last line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from job_testing import FAULTS_ALONE
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from lightning_distmm import faults, lightning_seam

ROOT_CAUSE = faults.FailureRecord(2, time.time(), "ValueError", "a bad batch", False)


def test_last_words_name_the_recorded_cause_or_how_the_rank_ended():
    assert faults.launcher_last_words([(1, 0), (2, None)], lambda: ROOT_CAUSE) is None  # nothing ended badly
    line = faults.launcher_last_words([(1, -15), (2, 1)], lambda: ROOT_CAUSE)
    assert line == "distmm: rank 2: ValueError: a bad batch (the launcher ends the job)"
    line = faults.launcher_last_words([(1, -15)], lambda: None)
    assert line is not None and line.startswith("distmm: rank 1 was ended by SIGTERM without recording an error")
    assert "exited with code 3" in str(faults.launcher_last_words([(5, 3)], lambda: None))


@pytest.mark.slow
def test_the_observer_says_them_before_it_kills_the_job():
    """A real observer over a child ended by SIGTERM; the process it kills is a stand-in sleeper."""
    child = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    stand_in = subprocess.Popen(["sleep", "60"])
    said: list[list[tuple[int, int | None]]] = []
    observer = _ChildProcessObserver(main_pid=stand_in.pid, child_processes=[child], sleep_period=1)
    observer.start()
    try:
        assert lightning_seam.before_observer_ends_job(said.append)
        assert not lightning_seam.before_observer_ends_job(said.append)  # wrapped once
        assert stand_in.wait(timeout=20) == -signal.SIGKILL  # the observer still ends the job
        assert said == [[(1, -signal.SIGTERM)]]  # ... after saying who ended how
    finally:
        stand_in.kill()
        observer._finished = True


@pytest.mark.slow
def test_a_clean_up_sigterm_after_the_root_cause_repeats_it():
    script = FAULTS_ALONE + (
        "import os, signal, time\n"
        "cause = None\n"
        "signal.signal(signal.SIGTERM, faults.preemption_handler(1, None, lambda: cause))\n"
        "print('started', flush=True)\n"
        "cause = 'distmm: rank 2: ValueError: a bad batch'\n"
        "sys.stderr.write('Traceback ... ValueError: a bad batch\\n'); sys.stderr.flush()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "distmm: rank 2: ValueError: a bad batch"
    assert "received SIGTERM" not in proc.stderr
    # before any failure, SIGTERM is the cause: Preempted names it
    script = script.replace("cause = 'distmm", "_ = 'distmm")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("rank 1 received SIGTERM")
