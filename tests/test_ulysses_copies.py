"""The copies around Ulysses' all-to-alls (``models.ulysses``): q, k and v go into one send buffer written once each
(no stack of the three and then a second stack per rank), the received buffer is the sequence (no concatenation),
and no zero-padded copy of a whole tensor is made to shard it or to send it back. The values are checked on 5 gloo
ranks against one process in ``tests/test_ulysses.py``; here, what runs."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.ulysses import StandInUlysses


class OpLog(TorchDispatchMode):
    """The aten ops run inside, with the bytes each ``copy_`` wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.copied = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops.append(str(func.overloadpacket.__name__))
        if func.overloadpacket is torch.ops.aten.copy_:
            self.copied += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def test_qkv_to_heads_writes_q_k_and_v_once_into_one_send_buffer_and_concatenates_nothing() -> None:
    sp, n_local, heads, hd = StandInUlysses(5), 12, 10, 4
    q, k, v = (torch.randn(n_local, heads, hd) for _ in range(3))
    with OpLog() as log:
        qh, kh, vh = sp.qkv_to_heads(q, k, v, 57)
    assert "stack" not in log.ops and "cat" not in log.ops
    assert log.copied == 3 * q.numel() * q.element_size()  # each input once, nothing else
    assert qh.shape == (57, 2, hd)
    # the stand-in hands back its own send buffer: block r of the sequence is this rank's tokens at rank r's heads
    torch.testing.assert_close(qh[:n_local], q[:, :2], rtol=0, atol=0)
    torch.testing.assert_close(kh[n_local : 2 * n_local], k[:, 2:4], rtol=0, atol=0)
    torch.testing.assert_close(vh[4 * n_local :], v[:9, 8:], rtol=0, atol=0)  # 57 = 4 x 12 + 9 real rows


def test_heads_to_seq_zeroes_only_the_padding_rows_instead_of_copying_a_padded_whole() -> None:
    sp, n, hd = StandInUlysses(5), 23, 4  # 23 tokens: 2 rows of padding to 25
    x = torch.randn(n, 2, hd)
    with OpLog() as log:
        out = sp.heads_to_seq(x)
    assert "cat" not in log.ops
    assert out.shape == (5, 10, hd)
    torch.testing.assert_close(out[:, :2], x[:5], rtol=0, atol=0)  # rank 0's tokens, the heads "from" rank 0


def test_shard_is_a_view_where_the_rows_are_real_and_pads_only_the_last_ranks_rows() -> None:
    x = torch.randn(23, 3)
    reference = torch.cat([x, x.new_zeros(2, 3)])  # what the shards were cut from before: 25 rows
    for rank in range(5):
        got = StandInUlysses(5, rank).shard(x)
        torch.testing.assert_close(got, reference[5 * rank : 5 * rank + 5], rtol=0, atol=0)
        assert (got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) == (rank < 4)
