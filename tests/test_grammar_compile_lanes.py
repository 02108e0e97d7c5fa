"""CompileLanes (issue 55, item 6): one client's slow compile never holds the others back by
more than the fast budget; a compile past its deadline fails naming the flag; a cancelled one
is forgotten or stopped. The policy alone, on a clock the test moves."""

from __future__ import annotations

import pytest

from pydaemon.structured_output.compile_lanes import CompileJob, CompileLanes


def _lanes(**kw) -> CompileLanes:
    return CompileLanes(max_running=2, fast_budget_s=2.0, deadline_s=30.0, **kw)


def _ids(jobs) -> list[int]:
    return [j.job_id for j in jobs]


def test_a_slow_compile_keeps_running_and_the_fast_lane_keeps_a_slot():
    lanes = _lanes()
    lanes.add(CompileJob(0))  # slow
    assert _ids(lanes.tick(0.0).start) == [0]
    acts = lanes.tick(2.5)  # past the fast budget, and no other slow compile: it goes on
    assert not acts.stop and not acts.fail and lanes.running[0].slow
    for i in (1, 2, 3):
        lanes.add(CompileJob(i))
    assert _ids(lanes.tick(2.6).start) == [1]  # one slot stays the fast lane's
    lanes.finished(1)
    assert _ids(lanes.tick(2.7).start) == [2]
    lanes.finished(2)
    assert _ids(lanes.tick(2.8).start) == [3]


def test_a_second_slow_compile_is_stopped_and_queued_behind_the_first():
    lanes = _lanes()
    lanes.add(CompileJob(0))
    lanes.add(CompileJob(1))
    assert _ids(lanes.tick(0.0).start) == [0, 1]
    acts = lanes.tick(2.1)
    # Job 0 became the slow compile; job 1 crossed the budget too: stopped, queued slow.
    assert lanes.running[0].slow and _ids(acts.stop) == [1]
    lanes.add(CompileJob(2))
    assert _ids(acts.start) == [] and _ids(lanes.tick(2.2).start) == [2]  # fast goes first
    lanes.finished(2)
    assert lanes.tick(2.3).start == []  # the slow slot is taken: job 1 waits
    lanes.finished(0)
    restarted = lanes.tick(3.0).start
    assert _ids(restarted) == [1] and restarted[0].slow and restarted[0].started == 3.0


def test_a_compile_past_the_deadline_fails_naming_the_flag():
    lanes = _lanes()
    lanes.add(CompileJob(7))
    lanes.tick(0.0)
    lanes.tick(2.1)
    assert lanes.next_event(2.1) == pytest.approx(27.9)
    assert lanes.tick(29.0).fail == []
    (job, reason), *more = lanes.tick(30.5).fail
    assert job.job_id == 7 and not more and not lanes.running
    assert "within 30 s" in reason and "--structured-outputs-compile-timeout" in reason
    assert reason.startswith("structured_outputs:")


def test_cancel_forgets_a_queued_job_and_hands_back_a_running_one():
    lanes = _lanes()
    for i in range(3):
        lanes.add(CompileJob(i))
    lanes.tick(0.0)
    assert lanes.cancel(2) is None and lanes.num_queued == 0  # queued: forgotten
    assert lanes.cancel(0).job_id == 0 and 0 not in lanes.running  # running: to be killed
    assert lanes.cancel(5) is None
    assert lanes.next_event(1.0) == pytest.approx(1.0)  # job 1's fast budget


def test_lanes_need_a_fast_slot():
    with pytest.raises(ValueError, match="two slots"):
        CompileLanes(max_running=1)


def test_frames_survive_any_split_of_the_byte_stream():
    """The compile protocol's frames, read in pieces of every size (the server once lost the
    bytes read with its init frame: a compile sent right after it never ran)."""
    from pydaemon.structured_output.compile_server import FrameReader, encode_frame

    messages = [("init", "x" * 70_000, {"a": 1}), ("compile", 0, "y" * 3), ("cancel", 0)]
    data = b"".join(encode_frame(m) for m in messages)
    for size in (1, 7, 4096, len(data)):
        reader = FrameReader()
        got = []
        for i in range(0, len(data), size):
            got += reader.feed(data[i : i + size])
        assert got == messages, size
