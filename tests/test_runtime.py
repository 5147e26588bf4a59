"""The machine-facing defaults of issue 20: the thread choice and the bf16 policy (forced with MOETRAIN_BF16, as
one would prove the no-bf16 path on an AMX machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moetrain.runtime import cache_root, cpu
from moetrain.runtime import threads as threads_mod
from moetrain.runtime.threads import choose_threads, default_threads, others_busy_cores, serving_threads


@pytest.mark.parametrize("cores, load, want", [(2, 0.0, 2), (2, 1.2, 1), (2, 2.0, 1), (2, 6.0, 1), (16, 3.4, 13),
                                               (4, None, 4), (2, 0.5, 1), (4, 2.5, 1), (4, 2.49, 2)])
def test_default_threads_leave_the_loaded_cores(cores, load, want):
    assert default_threads(cores, load) == want


@pytest.mark.parametrize("cores, current, want", [(1, 1, 1), (2, 2, 1), (4, 4, 3), (16, 16, 15), (16, 4, 4),
                                                  (8, 1, 1)])
def test_serving_keeps_a_core_for_the_http_front(monkeypatch, cores, current, want):
    """``moetrain serve``'s default: the usable cores less one, at least 1, never more than PyTorch has now."""
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: current)
    assert serving_threads() == want


def test_an_explicit_setting_wins_and_a_lower_current_count_is_kept():
    n = torch.get_num_threads()
    try:
        assert choose_threads(2).threads == 2 and torch.get_num_threads() == 2
        torch.set_num_threads(1)  # e.g. OMP_NUM_THREADS=1
        assert choose_threads(0).threads == 1
    finally:
        torch.set_num_threads(n)


def test_others_busy_cores_subtracts_this_process_s_own_ticks(monkeypatch):
    """The arithmetic on made-up counters: 0.1 s at 100 ticks/s is 10 ticks of one core; the usable CPUs were busy
    for 25 ticks, 7 of them this process's, so other processes kept 1.8 cores busy."""
    machine, own, clock = iter([1000, 1025]), iter([500, 507]), iter([10.0, 10.1])
    monkeypatch.setattr(threads_mod, "_cpu_ticks", lambda cpus: next(machine))
    monkeypatch.setattr(threads_mod, "_own_ticks", lambda: next(own))
    monkeypatch.setattr(threads_mod.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(threads_mod.time, "sleep", lambda s: None)
    monkeypatch.setattr(threads_mod.os, "sysconf", lambda name: 100)
    monkeypatch.setattr(threads_mod.os, "sched_getaffinity", lambda pid: {0, 1})
    assert others_busy_cores() == pytest.approx(1.8)


def test_a_proc_stat_without_the_affinity_s_cpus_or_unparsable_gives_no_measure(monkeypatch, tmp_path):
    """An offline CPU, a container's renumbered ``/proc/stat``, or a malformed line: no measure (the load average
    decides), never a made-up 0 that would take every core."""
    stat = tmp_path / "stat"
    monkeypatch.setattr(threads_mod, "Path", lambda name: stat if name == "/proc/stat" else Path(name))
    stat.write_text("cpu  9 0 9 9 0 0 0 0 0 0\ncpu0 5 0 4 9 0 0 0 0 0 0\n")
    assert threads_mod._cpu_ticks({0}) == 9
    assert threads_mod._cpu_ticks({0, 1}) is None  # cpu1 has no line
    stat.write_text("cpu0 5 0 4\n\n")
    assert threads_mod._cpu_ticks({0}) is None  # too few fields
    stat.write_text("cpu0 5 x 4 9 0 0 0 0 0 0\n")
    assert threads_mod._cpu_ticks({0}) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc")
def test_the_proc_counters_agree_with_the_process_clock_and_see_a_spinning_child():
    """This process's ticks (``/proc/self/stat``) advance with ``time.process_time`` (an independent clock of the
    same CPU time) while it spins, and the usable CPUs' busy ticks by at least as much; a child spinning on a core is
    counted as another process's (whatever else runs, the measure is at least half a core, at most the cores)."""
    hz = os.sysconf("SC_CLK_TCK")
    cpus = os.sched_getaffinity(0)
    own0, busy0, clock0 = threads_mod._own_ticks(), threads_mod._cpu_ticks(cpus), time.process_time()
    while time.process_time() - clock0 < 0.3:
        pass
    own1, busy1, clock1 = threads_mod._own_ticks(), threads_mod._cpu_ticks(cpus), time.process_time()
    assert abs((own1 - own0) / hz - (clock1 - clock0)) < 0.05
    assert busy1 - busy0 >= own1 - own0 - len(cpus)  # one tick of rounding per CPU
    cores = len(cpus)
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert min(cores, 0.5) <= others_busy_cores(0.3) <= cores
    finally:
        child.kill()
        child.wait()


def test_the_default_follows_the_busy_cores_not_the_load_average(monkeypatch):
    """Right after ``pip install`` the load average still counts it (0.8-1.5 on an idle 2-core machine); the cores
    busy now decide. Where they cannot be measured the load average does."""
    n = torch.get_num_threads()
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads_mod, "load_average", lambda: [1.5, 1.2, 0.9])
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(threads_mod, "others_busy_cores", lambda: 0.1)
        choice = choose_threads(0)
        assert (choice.threads, choice.busy) == (2, 0.1)
        assert "0.1 of them busy with other processes, load average 1.5" in choice.line()
        torch.set_num_threads(2)
        monkeypatch.setattr(threads_mod, "others_busy_cores", lambda: 1.2)
        assert choose_threads(0).threads == 1
        torch.set_num_threads(2)
        monkeypatch.setattr(threads_mod, "others_busy_cores", lambda: None)
        assert choose_threads(0).threads == 1  # load average 1.5 -> 2 - 2 -> at least 1
    finally:
        torch.set_num_threads(n)


@pytest.fixture
def forced(monkeypatch):
    def force(value: str):
        monkeypatch.setenv(cpu.BF16_ENV, value)
        cpu.bf16_support.cache_clear()

    yield force
    cpu.bf16_support.cache_clear()


def test_forcing_the_no_bf16_path(forced):
    from moetrain.config import build_config
    from moetrain.model.transformer import MoETransformer
    from moetrain.train.step import autocast_context

    forced("fp32")
    assert not cpu.bf16_compute("cpu")
    assert "computes in fp32" in cpu.bf16_policy_line("bf16", "cpu")
    with autocast_context(torch.device("cpu"), "bf16"):
        assert not torch.is_autocast_enabled("cpu")  # the trainer's bf16 is fp32 here
    torch.manual_seed(0)
    model = MoETransformer(build_config("tiny", None, {}).model)
    ids = torch.randint(0, 512, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller's own autocast
        out = model(ids)
    assert out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, model(ids).logits, rtol=0, atol=0)  # exactly the fp32 model
    forced("bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(ids).logits.dtype == torch.bfloat16
    with autocast_context(torch.device("cpu"), "bf16"):
        assert torch.is_autocast_enabled("cpu")


def test_a_bad_force_value_names_the_variable(forced):
    from moetrain.errors import ConfigError

    forced("fp16")
    with pytest.raises(ConfigError, match="MOETRAIN_BF16: must be one of auto, bf16, fp32, got 'fp16'"):
        cpu.bf16_support("cpu")


@pytest.mark.parametrize(("flags", "env", "fast"), [
    ({"avx512_bf16"}, {}, True),
    ({"amx_bf16", "avx512_bf16"}, {}, True),
    (set(), {}, False),  # AVX2-only: the ~100x slower path
    ({"avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),  # the reproduction of docs/robustness.md
    ({"avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "avx512_core_amx"}, True),
    ({"avx512_bf16"}, {"ATEN_CPU_CAPABILITY": "avx2"}, False),
])
def test_the_decision_follows_the_cpu_features(forced, monkeypatch, flags, env, fast):
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: set(flags) | {"avx2", "fma"})
    forced("auto")
    s = cpu.bf16_support("cpu")
    assert s.fast is fast
    assert s.flags == tuple(sorted(flags))
    assert (next(iter(env.values())).upper() in s.reason.upper()) if env and not fast else True


def test_the_decision_does_not_time_anything(forced, monkeypatch):
    """The model's numerics must not depend on a timing: no GEMM is run to decide."""
    monkeypatch.setattr(cpu, "_gemm_rate", lambda *a, **k: pytest.fail("bf16_support timed a GEMM"))
    forced("auto")
    cpu.bf16_support("cpu")


def test_one_cache_root_for_tokens_and_kernels(monkeypatch, tmp_path):
    """``data.cache_dir`` wins, then ``$MOETRAIN_CACHE``, then ``~/.cache/moetrain``; the CPU kernels keep theirs in
    ``kernels/`` of the same root."""
    from moetrain.moe.kernels.cpu import native

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MOETRAIN_CACHE", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "moetrain"
    assert native.cache_dir() == tmp_path / "home" / ".cache" / "moetrain" / "kernels"
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env" and native.cache_dir() == tmp_path / "env" / "kernels"
    assert cache_root("~/mine") == tmp_path / "home" / "mine"
