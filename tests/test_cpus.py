"""nextstep/cpus.py: the CPUs a process may use (affinity, a cgroup's quota) and the thread settings from them."""

import os

from nextstep.cpus import _quota, configure_threads, usable_cpus


def test_a_cgroup_quota_caps_the_cpus_and_none_leaves_the_affinity(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert _quota(tmp_path) is None and usable_cpus(tmp_path) == affinity  # (no cgroup files: no quota)
    (tmp_path / "cpu.max").write_text("max 100000\n")  # cgroup v2, no limit
    assert _quota(tmp_path) is None and usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: one whole thread, not two throttled ones
    assert _quota(tmp_path) == 1.5 and usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")  # cgroup v1: half a CPU is still one thread
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert _quota(tmp_path) == 0.5 and usable_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert _quota(tmp_path) is None


def test_the_thread_settings_are_defaults_a_users_variable_wins():
    environ = {"OMP_NUM_THREADS": "7"}
    assert configure_threads(environ) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert environ == {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "PASSIVE"}
    fresh: dict[str, str] = {}
    configure_threads(fresh)
    assert fresh == {"OMP_NUM_THREADS": str(usable_cpus()), "OMP_WAIT_POLICY": "PASSIVE"}
