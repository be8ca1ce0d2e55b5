"""umT5 encoder and tokenisation: bucket formula, masking, dtype, and the local-only tokenizers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from models.t5 import T5Config, T5Encoder, T5RelativeEmbedding
from models.tokenizer import ByteFallbackTokenizer, SentencePieceTokenizer, clean_prompt, pack_ids

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


def test_pack_ids_truncates_and_ends_with_eos() -> None:
    ids, mask = pack_ids(list(range(10, 20)), 4)
    assert ids.tolist() == [10, 11, 12, 1] and mask.tolist() == [1, 1, 1, 1]
    ids, mask = pack_ids([10], 4)
    assert ids.tolist() == [10, 1, 0, 0] and mask.tolist() == [1, 1, 0, 0]


def test_prompts_are_whitespace_cleaned() -> None:
    assert clean_prompt("  a \n\t castle&amp;moat ") == "a castle&moat"


def test_byte_fallback_tokenizer_is_deterministic_and_in_vocab() -> None:
    tok = ByteFallbackTokenizer(vocab=40, text_len=16)
    ids, mask = tok("héllo  world")
    assert torch.equal(ids, tok("héllo world")[0])
    assert int(ids.max()) < 40 and int(mask.sum()) == len("héllo world".encode()) + 1


@pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is not None, reason="sentencepiece is installed")
def test_missing_sentencepiece_gives_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ImportError, match="sentencepiece"):
        SentencePieceTokenizer(tmp_path / "spiece.model", 8)


@pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is None, reason="sentencepiece not installed")
def test_tokenizer_folder_without_a_model_is_reported(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"spiece\.model"):
        SentencePieceTokenizer.from_dir(tmp_path, 8)
