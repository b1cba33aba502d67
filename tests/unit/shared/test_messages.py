"""Every message kind survives a MessagePack round trip through its direction's decoder."""

from __future__ import annotations

import msgspec
import pytest

from shared import messages as m

SP = m.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=7, logprobs=2, logit_bias={5: -1.5, 9: 100.0},
                      allowed_token_ids=[1, 2], bad_words_token_ids=[[3], [4, 5]], grammar='{"grammars": []}')
STOP = m.StopParams(max_tokens=16, min_tokens=2, eos_token_ids=[2], stop_token_ids=[5], ignore_eos=True)
LP = m.SampleLogprobs(sampled=m.TokenLogprob(3, -0.5), top=[m.TokenLogprob(3, -0.5), m.TokenLogprob(4, -1.5)])

CASES: list[tuple[msgspec.Struct, msgspec.msgpack.Decoder]] = [
    (m.AddRequest("r1", "g1", [1, 2, 3], SP, STOP, priority=2, arrival_time=1.5, queue_timeout_s=3.0), m.to_scheduler_decoder),
    (m.AbortRequest("g1", ["r1", "r2"]), m.to_scheduler_decoder),
    (m.GatewayHeartbeat("g1", 12.5), m.to_scheduler_decoder),
    (
        m.RequestDeltas(
            4,
            [
                m.RequestDelta("r1", [9, 10], logprobs=[LP, LP]),
                m.RequestDelta(
                    "r2", [], finish_reason="stop", stop_token_id=2, num_prompt_tokens=5, num_cached_tokens=4,
                    timings=m.RequestTimings(1.0, 1.1, 1.2, 1.3, num_preemptions=1),
                ),
            ],
        ),
        m.to_gateway_decoder,
    ),
    (m.RequestRejected("r3", "queue_full", "the waiting queue is full", retry_after_s=2.0), m.to_gateway_decoder),
    (
        m.EngineStats(
            time=1.0, num_running=2, num_waiting=1, num_kv_blocks_total=10, num_kv_blocks_free=4, kv_usage=0.6,
            num_running_by_priority={0: 2}, process_rss_bytes={"scheduler": 5}, rejected_total={"queue_full": 3}, step_num_tokens=[5, 6],
            running=[m.RequestSummary("r1", 0, 5, 2, 7, 0.5)], config={"max_num_seqs": "4"},
        ),
        m.to_gateway_decoder,
    ),
    (m.EngineHealth(time=2.0, scheduler_ready=True, num_workers=2, workers_ready=[0, 1], model="x"), m.to_gateway_decoder),
    (
        m.StepPlan(
            step_id=3,
            new_requests=[m.NewRequestData("r1", [1, 2], SP, [0, 1], 0)],
            cached_requests=[m.CachedRequestData("r2", [7], 33)],
            resumed_requests=[m.NewRequestData("r3", [1], SP, [2], 0, output_token_ids=[4, 5])],
            preempted_req_ids=["r4"],
            finished_req_ids=["r5"],
            num_scheduled_tokens={"r1": 2, "r2": 1, "r3": 3},
            total_num_scheduled_tokens=6,
        ),
        m.to_worker_decoder,
    ),
    (m.Shutdown("bye"), m.to_worker_decoder),
    (m.Shutdown("rank 1 was declared dead", rank=1), m.to_worker_decoder),
    (m.WorkerReady(rank=0, num_kv_blocks=100, block_size=16, model="x", pid=5), m.from_worker_decoder),
    (m.StepResult(step_id=3, rank=0, req_ids=["r1"], sampled_token_ids=[8], logprobs=[LP], forward_s=0.1), m.from_worker_decoder),
    (m.WorkerHeartbeat(rank=0, pid=9, time=3.0, rss_bytes=100, peak_rss_bytes=200), m.from_worker_decoder),
    (m.WorkerError(rank=1, message="boom", step_id=3), m.from_worker_decoder),
]


@pytest.mark.parametrize("msg,decoder", CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_round_trip(msg: msgspec.Struct, decoder: msgspec.msgpack.Decoder) -> None:
    data = m.encode(msg)
    back = decoder.decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert m.any_decoder.decode(data) == msg


def test_every_kind_is_covered() -> None:
    kinds = {type(c[0]) for c in CASES}
    tagged = {
        obj for obj in vars(m).values()
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__struct_config__.tag
    }
    assert tagged == kinds


def test_wrong_direction_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        m.to_worker_decoder.decode(m.encode(m.GatewayHeartbeat("g", 1.0)))
