"""umT5 encoder: bucket formula, masking, dtype (tokenisation: tests/test_tokenizer.py)."""

from __future__ import annotations

import pytest
import torch

from models.t5 import T5Config, T5Encoder, T5RelativeEmbedding
from models.tokenizer import pack_ids

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def t5() -> T5Encoder:
    torch.manual_seed(0)
    return T5Encoder(T5Config.preset("tiny")).eval()


def test_relative_buckets_follow_the_bidirectional_log_formula() -> None:
    emb = T5RelativeEmbedding(num_buckets=32, num_heads=2, max_dist=128)  # nb = 16, max_exact = 8
    rel = torch.tensor([0, -1, 1, -7, -8, -12, 12, -127, -128, 500])
    # exact below 8; then 8 + trunc(log(a/8)/log(16) * 8), capped at 15; keys after the query add 16
    assert emb.bucket(rel).tolist() == [0, 1, 17, 7, 8, 9, 25, 15, 15, 31]


def test_every_layer_owns_its_position_table_unless_shared() -> None:
    keys = set(T5Encoder(T5Config.preset("tiny")).state_dict())
    assert {"blocks.0.pos_embedding.embedding.weight", "blocks.1.pos_embedding.embedding.weight"} <= keys
    assert "blocks.0.ffn.gate.0.weight" in keys and "token_embedding.weight" in keys and "norm.weight" in keys


@torch.no_grad()
def test_padding_tokens_do_not_change_the_valid_rows(t5: T5Encoder) -> None:
    ids, mask = pack_ids([5, 6, 7], 8)
    other = ids.clone()
    other[4:] = torch.tensor([9, 10, 11, 12])  # garbage behind the mask
    a, b = t5.context(ids, mask), t5.context(other, mask)
    assert a.shape == (4, 32)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@torch.no_grad()
def test_bfloat16_encoder_tracks_float32(t5: T5Encoder) -> None:
    ids, mask = pack_ids([5, 6, 7, 8, 9], 8)
    ref = t5.context(ids, mask)
    low = T5Encoder(t5.cfg).eval()
    low.load_state_dict(t5.state_dict())
    out = low.to(torch.bfloat16).context(ids, mask)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()
