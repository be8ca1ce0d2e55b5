"""Prompt tokenisation as the reference does it: ftfy + HTML + whitespace cleaning, then the umT5 tokenizer from its
local ``tokenizer.json`` (or ``spiece.model``), packed to ``text_len`` with EOS and padding."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import sentencepiece
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import Unigram

from models.tokenizer import (
    ByteFallbackTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    clean_prompt,
    pack_ids,
    tokenizer_from_dir,
)

# A tokenizer.json shaped like umT5's (Unigram with byte fallback, Metaspace, <pad>=0, </s>=1, <unk>=2) whose vocab
# holds exactly the pieces the prompts below need, so every expected id is the index of a listed piece.
SPECIAL = ["<pad>", "</s>", "<unk>"]
BYTES = [f"<0x{i:02X}>" for i in range(256)]  # ids 3..258
WORDS = ["▁", '▁"', "Hello", '"', "▁fine", "▁&", "▁ABC", "!", "▁a", "▁castle", "▁fl", "ower", "▁'", "quoted", "'"]
ID = {piece: i for i, piece in enumerate(SPECIAL + BYTES + WORDS)}


def write_umt5_like_tokenizer(folder: Path) -> Path:
    vocab = [(p, 0.0) for p in SPECIAL] + [(p, -20.0) for p in BYTES] + [(p, -1.0) for p in WORDS]
    tok = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_cleaning_straightens_quotes_narrows_full_width_splits_ligatures_and_unescapes_html() -> None:
    assert clean_prompt("“Hello” ﬁne &amp;amp; ＡＢＣ！") == '"Hello" fine & ABC!'
    assert clean_prompt("‘quoted’\t\n  a   castle ") == "'quoted' a castle"
    assert clean_prompt("ﬂower 🙂") == "flower 🙂"  # emoji pass through untouched


def test_hf_tokenizer_gives_the_ids_of_the_cleaned_prompt_then_eos_then_padding(tmp_path: Path) -> None:
    tok = HFTokenizer(write_umt5_like_tokenizer(tmp_path) / "tokenizer.json", text_len=16)
    ids, mask = tok("“Hello” ﬁne &amp;amp; ＡＢＣ！ 🙂")
    emoji = [ID["<0xF0>"], ID["<0x9F>"], ID["<0x99>"], ID["<0x82>"]]  # UTF-8 of U+1F642 through byte fallback
    want = [ID['▁"'], ID["Hello"], ID['"'], ID["▁fine"], ID["▁&"], ID["▁ABC"], ID["!"], ID["▁"], *emoji, 1]
    assert ids.tolist() == want + [0] * (16 - len(want))
    assert mask.tolist() == [1] * len(want) + [0] * (16 - len(want))
    assert tok.pieces("‘quoted’ ﬂower") == [ID["▁'"], ID["quoted"], ID["'"], ID["▁fl"], ID["ower"]]


def test_without_the_reference_cleaning_the_ids_would_differ(tmp_path: Path) -> None:
    raw = Tokenizer.from_file(str(write_umt5_like_tokenizer(tmp_path) / "tokenizer.json"))
    prompt = "“Hello” &amp; x"
    cleaned = HFTokenizer(tmp_path / "tokenizer.json", 8).pieces(prompt)
    assert raw.encode(prompt, add_special_tokens=False).ids != cleaned  # curly quotes and &amp; are bytes raw


def test_truncation_keeps_eos_as_the_last_valid_id() -> None:
    ids, mask = pack_ids(list(range(10, 20)), 4)
    assert ids.tolist() == [10, 11, 12, 1] and mask.tolist() == [1, 1, 1, 1]


def _train_spiece(folder: Path) -> Path:
    model = io.BytesIO()
    corpus = ["a castle on a hill", "the castle of a fine flower", "hello world"] * 20
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=300, hard_vocab_limit=False, minloglevel=2,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=True,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spiece.model").write_bytes(model.getvalue())
    return folder


def test_a_folder_with_only_spiece_model_falls_back_to_sentencepiece_with_the_same_cleaning(tmp_path: Path) -> None:
    folder = _train_spiece(tmp_path / "sp")
    tok = tokenizer_from_dir(folder, 12)
    assert isinstance(tok, SentencePieceTokenizer)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spiece.model"))
    ids, _ = tok("  a   castle&amp;amp;  ")
    pieces = sp.encode("a castle&")
    assert ids.tolist()[: len(pieces) + 1] == [*pieces, 1]
    write_umt5_like_tokenizer(folder)  # both present: the reference's tokenizer.json wins
    assert isinstance(tokenizer_from_dir(folder, 12), HFTokenizer)


def test_a_tokenizer_folder_without_either_file_is_reported_with_its_contents(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*spiece\.model.*notes\.txt"):
        tokenizer_from_dir(tmp_path, 8)


def test_a_tokenizer_json_that_is_not_umt5_is_refused(tmp_path: Path) -> None:
    tok = Tokenizer(Unigram([("<unk>", 0.0), ("</s>", 0.0), ("<pad>", 0.0)], unk_id=0))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="not an umT5 tokenizer"):
        HFTokenizer(tmp_path / "tokenizer.json", 8)


def test_byte_fallback_tokenizer_is_deterministic_and_in_vocab() -> None:
    tok = ByteFallbackTokenizer(vocab=40, text_len=16)
    ids, mask = tok("héllo  world")
    assert ids.tolist() == tok("héllo world")[0].tolist()
    assert int(ids.max()) < 40 and int(mask.sum()) == len("héllo world".encode()) + 1
