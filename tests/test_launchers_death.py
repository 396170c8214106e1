"""What a process that wrote no result died of (``harness.run.launchers.death``), shared by the
sweep's points and the Trainer bench's runs."""

import signal

from harness.run.launchers import death


def test_a_death_reads_as_the_sweep_has_always_read_it():
    assert death(-signal.SIGKILL, False, "", True, 60, "run") == (
        "oom", "out of host memory: the kernel's OOM killer ended the run (the machine's memory or its cgroup's "
        "limit)", "host")
    assert death(-signal.SIGKILL, False, "", None, 60)[:2] == ("error", "killed by SIGKILL (host out of memory?)")
    assert death(-signal.SIGKILL, False, "", False, 60)[1] == "killed by SIGKILL (not by the kernel's OOM killer)"
    assert death(1, False, "torch.OutOfMemoryError: CUDA out of memory", False, 60)[0] == "oom"
    assert death(-9, True, "", True, 60) == ("error", "timed out after 60 s", None)  # past its time first
    assert death(1, False, "Traceback", None, 60)[1] == "exited with code 1 without a result"


def test_a_real_time_signal_is_named_by_its_number_not_a_crash():
    rt = signal.SIGRTMIN + 2
    assert death(-rt, False, "", None, 60)[:2] == ("error", f"killed by signal {rt}")
