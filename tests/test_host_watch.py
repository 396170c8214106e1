"""harness.measure.host: the host's memory in use and the kernel's OOM kills, read beside a point."""

import time

from harness.measure import host

MEMINFO = "MemTotal:       {total} kB\nMemFree:         1000 kB\nMemAvailable:   {avail} kB\nBuffers: 1 kB\n"


def _meminfo(path, total_gib: float, used_gib: float) -> None:
    kib = 2**20
    path.write_text(MEMINFO.format(total=int(total_gib * kib), avail=int((total_gib - used_gib) * kib)))


def test_the_readings_come_from_meminfo_and_vmstat(tmp_path):
    _meminfo(tmp_path / "meminfo", 128, 40.5)
    (tmp_path / "vmstat").write_text("nr_free_pages 12\noom_kill 3\npgfault 9\n")
    assert abs(host.used_gib(tmp_path / "meminfo") - 40.5) < 1e-6
    assert host.oom_kills(tmp_path / "vmstat") == 3
    # a kernel that does not count OOM kills, or no /proc: not known rather than zero
    (tmp_path / "old").write_text("nr_free_pages 12\n")
    assert host.oom_kills(tmp_path / "old") is None and host.oom_kills(tmp_path / "none") is None
    assert host.used_gib(tmp_path / "none") is None


def test_a_watch_keeps_the_peak_and_sees_an_oom_kill_meanwhile(tmp_path):
    meminfo, vmstat = tmp_path / "meminfo", tmp_path / "vmstat"
    _meminfo(meminfo, 128, 10)
    vmstat.write_text("oom_kill 5\n")
    with host.Watch(interval_s=0.01, vmstat=vmstat, meminfo=meminfo) as w:
        time.sleep(0.05)
        _meminfo(meminfo, 128, 120)  # the host fills, then the killer frees it
        time.sleep(0.1)
        vmstat.write_text("oom_kill 6\n")
        _meminfo(meminfo, 128, 12)
        time.sleep(0.05)
    assert abs(w.peak_gib - 120) < 1e-6 and w.oom_killed is True

    with host.Watch(interval_s=0.01, vmstat=vmstat, meminfo=meminfo) as w:
        pass
    assert abs(w.peak_gib - 12) < 1e-6 and w.oom_killed is False

    with host.Watch(interval_s=0.01, vmstat=tmp_path / "none", meminfo=tmp_path / "none") as w:
        pass
    assert w.peak_gib is None and w.oom_killed is None
