"""One stream per role thread and events at hand-offs (``ipc.streams``), on CPU: the same lanes and hand-offs as on a
GPU, with no stream, event or sync behind them. The CUDA branch is the few lines those functions add on a GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from ipc.streams import RoleStreams, hand_off, lane, take_over
from ipc.tensor_plane import Mailbox
from ranks.worker import Spans

CPU = torch.device("cpu")


def test_on_cpu_a_role_thread_enters_its_lane_with_no_stream_and_nothing_to_sync() -> None:
    streams = RoleStreams(CPU)
    assert streams.stream("decode") is None and not streams.cuda
    assert lane() is None
    with streams.enter("decode"):
        assert lane() == "decode"
        streams.synchronize()  # nothing queued anywhere: returns at once
        spans = Spans(streams)
        with spans.span("decode"):
            pass
        assert [s.name for s in spans.items] == ["decode"]
    assert lane() is None


def test_a_thread_cannot_enter_a_second_lane_inside_its_first() -> None:
    streams = RoleStreams(CPU)
    with streams.enter("condition"):
        with pytest.raises(RuntimeError, match="on lane 'condition', cannot enter 'denoise'"), \
                streams.enter("denoise"):
            pass
        assert lane() == "condition"  # the failed entry left the thread on its lane
    assert lane() is None


def test_a_mailbox_hands_a_tensor_over_with_the_producers_lane_and_the_same_storage() -> None:
    streams = RoleStreams(CPU)
    box = Mailbox()
    made: list[torch.Tensor] = []
    taken: list[torch.Tensor] = []

    def produce() -> None:
        with streams.enter("decode"):
            made.append(torch.arange(6))
            box.put(("s", 0), made[0])

    def consume() -> None:
        with streams.enter("frames"):
            taken.append(box.take(("s", 0), timeout_s=30))

    threads = [threading.Thread(target=consume), threading.Thread(target=produce)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert taken and taken[0] is made[0]  # no copy, no wait: on CPU a hand-off is the tensor itself


def test_a_hand_off_records_where_it_was_made_and_carries_an_event_only_for_a_cuda_tensor() -> None:
    with RoleStreams(CPU).enter("denoise"):
        handoff = hand_off(torch.ones(2))
    assert (handoff.lane, handoff.event) == ("denoise", None)
    assert hand_off("not a tensor").event is None and hand_off(torch.ones(1)).lane is None
    assert take_over(handoff) is handoff.value
