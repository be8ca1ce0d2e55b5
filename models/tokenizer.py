"""Prompt tokenisation for the umT5 encoder, from local files only (no hub access).

A tokenizer is any callable ``prompt -> (ids [T] int64, mask [T] int64)`` with ``T = text_len``: the pieces of
the cleaned prompt, truncated to ``T - 1``, then the end-of-sequence id, then padding (``mask`` is 1 on the valid
ids), which is what the reference's ``tokenizer(..., padding="max_length", truncation=True, max_length=T,
add_special_tokens=True)`` returns.

Cleaning is the reference's ``whitespace`` mode: ``ftfy.fix_text`` (curly quotes to straight, full-width to
half-width, ligatures split, mojibake repaired), ``html.unescape`` twice, strip, collapse whitespace.

``HFTokenizer`` reads the ``tokenizer.json`` of ``google/umt5-xxl`` with the ``tokenizers`` library: the tokenizer
the reference uses (its fast ``AutoTokenizer``). ``SentencePieceTokenizer`` is the fallback when a folder holds only
``spiece.model`` (the optional ``sentencepiece`` package). ``ByteFallbackTokenizer`` exists for tiny random-weight
configurations in tests and demos that have no tokenizer file; it is *not* umT5's tokenizer and is never chosen
when a tokenizer folder is configured.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import ftfy
import torch

Tokenizer = Callable[[str], tuple[torch.Tensor, torch.Tensor]]  # prompt -> (ids [T], mask [T])

PAD_ID = 0  # umT5 pad
EOS_ID = 1  # umT5 end of sequence (the last valid id of every prompt)
MODEL_FILE_NAMES = ("spiece.model", "tokenizer.model", "sentencepiece.model")
TOKENIZER_JSON = "tokenizer.json"


def clean_prompt(text: str) -> str:
    """The reference's ``whitespace`` cleaning: ftfy, HTML unescape twice, strip, collapse whitespace."""
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


def pack_ids(pieces: Sequence[int], text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pieces[:text_len-1] + [EOS]`` padded with ``PAD_ID`` to ``text_len``; mask 1 on the valid ids."""
    assert text_len >= 1, "text_len must be positive"
    valid = [*list(pieces)[: text_len - 1], EOS_ID]
    ids = torch.full((text_len,), PAD_ID, dtype=torch.int64)
    ids[: len(valid)] = torch.tensor(valid, dtype=torch.int64)
    mask = torch.zeros(text_len, dtype=torch.int64)
    mask[: len(valid)] = 1
    return ids, mask


class HFTokenizer:
    """umT5 tokenizer from a local ``tokenizer.json`` (the ``tokenizers`` library, no hub access)."""

    def __init__(self, tokenizer_file: str | Path, text_len: int) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(tokenizer_file)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        self.text_len = text_len
        self._tok = _Tokenizer.from_file(str(path))
        self._tok.no_truncation()
        self._tok.no_padding()
        eos = self._tok.token_to_id("</s>")
        if eos != EOS_ID or self._tok.token_to_id("<pad>") != PAD_ID:
            raise ValueError(f"{path} is not an umT5 tokenizer: </s> has id {eos}, <pad> has id "
                             f"{self._tok.token_to_id('<pad>')} (expected {EOS_ID} and {PAD_ID})")

    def pieces(self, prompt: str) -> list[int]:
        """Ids of the cleaned prompt without special tokens."""
        return self._tok.encode(clean_prompt(prompt), add_special_tokens=False).ids

    def __call__(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        return pack_ids(self.pieces(prompt), self.text_len)


def tokenizer_from_dir(tokenizer_dir: str | Path, text_len: int) -> Tokenizer:
    """The umT5 tokenizer of a folder: ``tokenizer.json`` if present (the reference's), else its SentencePiece file."""
    folder = Path(tokenizer_dir)
    if (folder / TOKENIZER_JSON).is_file():
        return HFTokenizer(folder / TOKENIZER_JSON, text_len)
    return SentencePieceTokenizer.from_dir(folder, text_len)


class SentencePieceTokenizer:
    """umT5 tokenizer loaded from a local SentencePiece model file."""

    def __init__(self, model_file: str | Path, text_len: int) -> None:
        try:
            import sentencepiece
        except ImportError as e:
            raise ImportError(
                "the umT5 tokenizer needs the optional package 'sentencepiece' "
                "(pip install 'worldstream[tokenizer]' or pip install sentencepiece)"
            ) from e
        model_file = Path(model_file)
        if not model_file.is_file():
            raise FileNotFoundError(f"SentencePiece model {model_file} does not exist")
        self.text_len = text_len
        self.model_file = model_file
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))

    @classmethod
    def from_dir(cls, tokenizer_dir: str | Path, text_len: int) -> SentencePieceTokenizer:
        """Find the SentencePiece model inside a tokenizer folder (``spiece.model`` in the umT5 release)."""
        folder = Path(tokenizer_dir)
        for name in MODEL_FILE_NAMES:
            if (folder / name).is_file():
                return cls(folder / name, text_len)
        found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "(folder missing)"
        raise FileNotFoundError(f"no {TOKENIZER_JSON} and no SentencePiece model {list(MODEL_FILE_NAMES)} in "
                                f"{folder}; contents: {found}")

    def __call__(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        return pack_ids(self._sp.encode(clean_prompt(prompt)), self.text_len)


class ByteFallbackTokenizer:
    """Test-only stand-in: UTF-8 bytes mapped into ``[2, vocab)``; deterministic, not umT5's tokenizer."""

    def __init__(self, vocab: int, text_len: int) -> None:
        assert vocab > 2, "vocab must leave room for pad and eos"
        self.vocab = vocab
        self.text_len = text_len

    def __call__(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = clean_prompt(prompt).encode("utf-8")
        return pack_ids([2 + b % (self.vocab - 2) for b in data], self.text_len)
