"""spec_cli.threads: the thread count a timed stage chooses for given (cores, load), and the verdict on
how busy the machine was, from injected measurements (nothing here times anything real)."""

import os

import pytest
import torch

from spec_cli import threads


@pytest.mark.parametrize(
    "cores, load, expected",
    [
        (2, 0.0, 2),  # a quiet machine: every core
        (2, 0.2, 2),  # background noise is not worth a thread
        (2, 1.0, 1),  # a neighbour on one core: leave it that core (default threads ran 8x slower)
        (2, 1.9, 1),
        (2, 6.0, 1),  # never fewer than one
        (16, 3.1, 13),
        (1, 0.9, 1),
    ],
)
def test_auto_leaves_the_cores_other_processes_use_to_them(cores, load, expected):
    choice = threads.choose(cores, load)
    assert choice.threads == expected
    assert f"{load:.1f}" in choice.reason and str(cores) in choice.reason


def test_an_explicit_count_wins_and_says_where_it_came_from():
    assert threads.choose(2, 1.5, requested=2) == threads.Choice(2, "--threads 2")
    assert "more than the 2 cores" in threads.choose(2, 0.0, requested=4).reason
    assert threads.choose(8, 0.0, env="1") == threads.Choice(
        1, "OMP_NUM_THREADS=1 in the environment"
    )
    assert (
        threads.choose(8, 0.0, requested=3, env="1").threads == 3
    )  # the flag over the environment
    for unusable in ("", "0", "two"):  # torch ignores these too: auto
        assert threads.choose(8, 0.0, env=unusable).threads == 8
    assert threads.choose(4, None).threads == 4 and "unknown" in threads.choose(4, None).reason


def test_choose_for_run_samples_the_machine_only_when_the_choice_depends_on_it(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads, "other_load", lambda seconds=0: pytest.fail("sampled"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads.choose_for_run() == threads.Choice(1, "OMP_NUM_THREADS=1 in the environment")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.choose_for_run(2).threads == 2
    monkeypatch.setattr(threads, "other_load", lambda seconds=0: 1.2)
    assert threads.choose_for_run().threads == 1


def test_busy_seconds_reads_only_our_cores_from_proc_stat():
    stat = (
        "cpu  300 0 30 900 10 0 0 0 0 0\n"
        "cpu0 100 0 10 500 5 0 0 0 0 0\n"
        "cpu1 200 0 20 400 5 1 2 3 0 0\n"
        "intr 12345\n"
    )
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert threads.busy_seconds(stat, {0}, count_niced=True) == pytest.approx(110 * tick)
    assert threads.busy_seconds(stat, {1}, count_niced=True) == pytest.approx(
        226 * tick
    )  # irq, softirq, steal
    assert threads.busy_seconds(stat, {0, 1}, count_niced=True) == pytest.approx(336 * tick)


def test_niced_neighbours_count_only_when_they_would_not_yield():
    stat = "cpu0 100 40 10 500 5 0 0 0 0 0\n"
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert threads.busy_seconds(stat, {0}, count_niced=True) == pytest.approx(150 * tick)
    assert threads.busy_seconds(stat, {0}, count_niced=False) == pytest.approx(110 * tick)


def test_the_verdict_names_the_numbers_and_what_to_do():
    assert threads.judge(0.95, 0.1, 2, 2) is None  # quiet
    assert threads.judge(0.97, 1.0, 1, 2) is None  # a neighbour on the core we left it: fair
    low = threads.judge(0.45, None, 2, 2)
    assert "got 45% of the 2 core(s) it used" in low and "fewer --threads (this run: 2)" in low
    crowded = threads.judge(0.9, 1.6, 2, 2)
    assert "other processes kept 1.6 of 2 cores busy (we left them 0)" in crowded
    assert "quiet machine" in threads.judge(0.5, 1.6, 1, 2) and "fewer" not in threads.judge(
        0.5, 1.6, 1, 2
    )
    assert threads.judge(threads.MIN_CPU_SHARE, 1.0 + threads.MAX_CONTENTION - 0.01, 1, 2) is None
    assert threads.judge(0.1, 5.0, 2, 2, on_cpu=False) is None  # an accelerator does the timed work


def test_meter_reports_what_the_process_got_from_injected_readers():
    readings = {
        "clock": iter([100.0, 110.0]),
        "cpu": iter([5.0, 8.0]),
        "busy": iter([1000.0, 1018.0]),
    }
    meter = threads.Meter(
        clock=readings["clock"].__next__,
        cpu=readings["cpu"].__next__,
        busy=readings["busy"].__next__,
    )
    busy = meter.stop(threads=1, cores=2)
    # 3 s of CPU over 10 s on 1 thread; 18 s busy on our cores, 3 of them ours: others 1.5 cores
    assert busy["cpu_share"] == pytest.approx(0.3) and busy["other_load"] == pytest.approx(1.5)
    assert busy["too_busy"] and "got 30%" in busy["warning"] and "1.5 of 2 cores" in busy["warning"]
    assert busy["threads"] == 1 and busy["cores"] == 2 and busy["seconds"] == 10.0
    quiet = threads.Meter(
        clock=iter([0.0, 10.0]).__next__, cpu=iter([0.0, 9.8]).__next__, busy=lambda: None
    ).stop(threads=1, cores=2)
    assert quiet["too_busy"] is False and quiet["warning"] is None and quiet["other_load"] is None


def test_applied_sets_and_restores_torch_threads():
    before = torch.get_num_threads()
    with threads.applied(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
