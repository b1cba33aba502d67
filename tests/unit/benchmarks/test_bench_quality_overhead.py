"""The quality-overhead benchmark's "checks off" switch: same requests, no answers kept or judged, restored after."""

from __future__ import annotations

import loadtests.client as client_module
import loadtests.runner as runner_module
from benchmarks.serving.quality_overhead import checks_off, judge_cost
from loadtests.client import RequestRecord
from loadtests.quality.mix import taskset_trace
from loadtests.quality.tasks import TaskItem, TaskSet

ITEM = TaskItem(id="a", task="arithmetic", checker="numeric", expected=4, max_tokens=4, prompt="2+2=")


def test_checks_off_keeps_nothing_and_is_undone() -> None:
    judge, init = runner_module.judge, client_module._StreamState.__init__
    with checks_off():
        state = client_module._StreamState(RequestRecord("a", "g", task="arithmetic"), 0.0, None, keep=True)
        assert state.keep is False
        assert runner_module.judge is not judge
    assert runner_module.judge is judge and client_module._StreamState.__init__ is init
    assert client_module._StreamState(RequestRecord("a", "g"), 0.0, None, keep=True).keep is True


def test_judge_cost_times_every_answer() -> None:
    trace = taskset_trace(TaskSet([ITEM], {"name": "t"}), 1, seed=0)
    cost = judge_cost(trace, {"a": {"text": "4", "tool_calls": [], "finish_reason": "stop"}, "zz": {}})
    assert cost["answers"] == 1 and cost["us_per_answer"] > 0
