"""The real model's condition and decode stages (``models.stages`` protocols) on the Wan2.1 VAE and umT5.

``LingbotConditionStage``: ``open`` encodes the prompt (cached by prompt hash) and starts the session's streaming
condition encoder; ``encode(session, k)`` returns ``y_k = [mask (4), normalised latent (16)]`` of shape
``[20, cs, h, w]``, the mask being 1 only in latent frame 0 of the stream.
``LingbotDecodeStage``: ``decode(session, k, latent)`` returns uint8 ``[n, H, W, 3]`` frames.

Memory per session is bounded for endless sessions: the decoder cache holds two frames per temporal layer, and
the condition encoder drops its cache once the black tail reaches its fixed point (``models.vae_stream``).
Factories at the bottom build both stages from a checkpoint directory, a golden fixture or tiny random weights.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from models.checkpoints import CheckpointNames, load_t5, load_vae, resolve_checkpoint_dir
from models.random_init import random_module
from models.stages import SessionSpec
from models.state_tree import flatten, to_device, unflatten
from models.t5 import T5Config, T5Encoder
from models.tokenizer import ByteFallbackTokenizer, Tokenizer, tokenizer_from_dir
from models.vae import VAEConfig, WanVAE
from models.vae_stream import ConditionEncoder, FrameDecoder, SessionTable, frames_to_uint8, image_from_uint8

MASK_CHANNELS = 4  # first-frame mask channels of y, fixed by the DiT's in_dim (36 = 16 noise + 4 mask + 16 latent)

class PromptCache:
    """Bounded LRU of prompt contexts keyed by the SHA-256 of the prompt."""

    def __init__(self, max_entries: int = 64) -> None:
        assert max_entries >= 1
        self.max_entries = max_entries
        self.misses = 0
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()

    @staticmethod
    def key(prompt: str) -> str:
        return hashlib.sha256(prompt.encode("utf-8")).hexdigest()

    def get_or_compute(self, prompt: str, compute: object) -> torch.Tensor:
        key = self.key(prompt)
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        self.misses += 1
        value = compute()  # type: ignore[operator]
        self._items[key] = value
        if len(self._items) > self.max_entries:
            self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)


class _PerSessionStage:
    """Release, memory and membership of a stage whose per-session state lives in ``self._sessions``."""

    _sessions: SessionTable[ConditionEncoder] | SessionTable[FrameDecoder]

    def release(self, session: str) -> None:
        self._sessions.release(session)

    def session_nbytes(self, session: str) -> int:
        return self._sessions.get(session).nbytes()

    def sessions_nbytes(self) -> int:
        return sum(item.nbytes() for item in self._sessions.values())

    def __contains__(self, session: str) -> bool:
        return session in self._sessions


class LingbotConditionStage(_PerSessionStage):
    """ConditionStage of LingBot-World-Fast: umT5 prompt context + streaming VAE condition ``y``."""

    def __init__(
        self,
        vae: WanVAE,
        t5: T5Encoder,
        tokenize: Tokenizer,
        chunk_latent_frames: int,
        *,
        dtype: torch.dtype = torch.float32,
        constant_tail: bool = True,
        prompt_cache_size: int = 64,
    ) -> None:
        self.vae = vae.eval()
        self.t5 = t5.eval()
        self.tokenize = tokenize
        self.cs = chunk_latent_frames
        self.dtype = dtype  # dtype of context and condition on the wire
        self.constant_tail = constant_tail
        self.prompts = PromptCache(prompt_cache_size)
        self._sessions: SessionTable[ConditionEncoder] = SessionTable("condition")
        self._contexts: dict[str, torch.Tensor] = {}  # each session's prompt context (a snapshot keeps it)

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @torch.no_grad()
    def context(self, prompt: str) -> torch.Tensor:
        """``[text_len, text_dim]``: the first L encoder rows of the prompt, then zero rows (cached)."""
        return self.prompts.get_or_compute(prompt, lambda: self._encode_prompt(prompt))

    def _encode_prompt(self, prompt: str) -> torch.Tensor:
        ids, mask = self.tokenize(prompt)  # [T], [T]
        t5_device = next(self.t5.parameters()).device
        valid = self.t5.context(ids.to(t5_device), mask.to(t5_device))  # [L, dim]
        out = torch.zeros(ids.shape[0], valid.shape[1], dtype=self.dtype, device=self.device)
        out[: valid.shape[0]] = valid.to(out)
        return out

    def open(self, spec: SessionSpec) -> torch.Tensor:
        assert spec.image is not None, "the condition stage needs the session's start image"
        height, width = (spec.height, spec.width) if spec.height else tuple(spec.image.shape[:2])
        s = self.vae.cfg.spatial_stride
        assert height % s == 0 and width % s == 0, f"frame H, W must be multiples of {s}, got {height}x{width}"
        context = self.context(spec.prompt)
        image = image_from_uint8(spec.image).to(self.device)  # [3, H0, W0] in [-1, 1]
        if tuple(image.shape[1:]) != (height, width):  # the start image at its own size -> the session's frame size
            image = F.interpolate(image[None], size=(height, width), mode="bicubic", align_corners=False)[0]
        self._sessions.open(spec.session, lambda: ConditionEncoder(self.vae, image, self.cs,
                                                                     constant_tail=self.constant_tail))  # fmt: skip
        self._contexts[spec.session] = context
        return context

    def encode(self, session: str, index: int) -> torch.Tensor:
        enc = self._sessions.get(session)
        if index != enc.index:
            raise ValueError(f"condition session {session!r}: chunk {index} requested, next is {enc.index}")
        latent = enc.next_chunk()  # [z, cs, h, w]
        mask = torch.zeros(MASK_CHANNELS, *latent.shape[1:], dtype=latent.dtype, device=latent.device)
        if index == 0:
            mask[:, 0] = 1.0  # only latent frame 0 of the stream carries the image
        return torch.cat([mask, latent], 0).to(self.dtype)  # [4 + z, cs, h, w]

    def state_dict(self, session: str) -> dict[str, torch.Tensor]:
        """The streaming encoder (its causal cache, fixed-point state, next chunk) and the prompt context."""
        return {**flatten(self._sessions.get(session).state(), "encoder"), "context": self._contexts[session]}

    def load_state(self, spec: SessionSpec, state: dict[str, torch.Tensor]) -> torch.Tensor:
        tree = to_device(unflatten(state, "encoder"), self.device)
        context = state["context"].to(device=self.device, dtype=self.dtype)
        self._sessions.open(spec.session, lambda: ConditionEncoder.restored(self.vae, self.cs, tree,
                                                                              constant_tail=self.constant_tail))
        self._contexts[spec.session] = context
        return context

    def release(self, session: str) -> None:
        super().release(session)
        self._contexts.pop(session, None)



class LingbotDecodeStage(_PerSessionStage):
    """DecodeStage of LingBot-World-Fast: per-session causal VAE decoding to uint8 RGB."""

    def __init__(self, vae: WanVAE, *, max_latent_frames_per_call: int | None = None) -> None:
        self.vae = vae.eval()
        self.max_latent_frames_per_call = max_latent_frames_per_call
        self._sessions: SessionTable[FrameDecoder] = SessionTable("decode")

    def open(self, spec: SessionSpec) -> None:
        limit = self.max_latent_frames_per_call
        self._sessions.open(spec.session, lambda: FrameDecoder(self.vae, max_latent_frames_per_call=limit))

    def decode_float(self, session: str, index: int, latent: torch.Tensor) -> torch.Tensor:
        """Frames ``[3, n, H, W]`` in [-1, 1] (the exact decoder output, for conformance checks)."""
        dec = self._sessions.get(session)
        if index != dec.index:
            raise ValueError(f"decode session {session!r}: chunk {index} arrived, next is {dec.index}")
        return dec.decode(latent)

    def decode(self, session: str, index: int, latent: torch.Tensor) -> torch.Tensor:
        return frames_to_uint8(self.decode_float(session, index, latent))

    def state_dict(self, session: str) -> dict[str, torch.Tensor]:
        """The decoder's causal cache after its last chunk and the next chunk's index."""
        return flatten(self._sessions.get(session).state(), "decoder")

    def load_state(self, spec: SessionSpec, state: dict[str, torch.Tensor]) -> None:
        tree = to_device(unflatten(state, "decoder"), next(self.vae.parameters()).device)
        self.open(spec)
        self._sessions.get(spec.session).load(tree)



@dataclass(frozen=True)
class VaeT5Stages:
    condition: LingbotConditionStage
    decode: LingbotDecodeStage


def stages_from_checkpoint(
    root: str | Path,
    chunk_latent_frames: int,
    *,
    text_len: int = 512,
    names: CheckpointNames | None = None,
    device: torch.device | str = "cuda",
    vae_dtype: torch.dtype = torch.float32,
) -> VaeT5Stages:
    """Real weights (sizes read from the files): VAE in ``vae_dtype``, umT5 in bf16 on GPU (fp32 on CPU), the
    tokenizer of the checkpoint's tokenizer folder. Context and condition leave as float32."""
    paths = resolve_checkpoint_dir(root, names)
    vae = load_vae(paths.vae_file, device=device, dtype=vae_dtype)
    t5 = load_t5(paths.t5_file, device=device)
    tokenize = tokenizer_from_dir(paths.tokenizer_dir, text_len)
    return VaeT5Stages(LingbotConditionStage(vae, t5, tokenize, chunk_latent_frames), LingbotDecodeStage(vae))
def random_stages(
    vae_cfg: VAEConfig,
    t5_cfg: T5Config,
    chunk_latent_frames: int,
    *,
    text_len: int = 16,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> VaeT5Stages:
    """Seeded random weights drawn on ``device`` (``random_vae`` and a umT5 in the compute dtype) and the byte
    tokenizer: a full-size model path runs without a download, never with meaningful frames."""
    vae = random_vae(vae_cfg, device, seed)
    t5_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    t5 = random_module(lambda: T5Encoder(t5_cfg), device, t5_dtype, seed + 1)
    assert isinstance(t5, T5Encoder)
    tokenize = ByteFallbackTokenizer(t5_cfg.vocab, text_len)
    return VaeT5Stages(LingbotConditionStage(vae, t5, tokenize, chunk_latent_frames), LingbotDecodeStage(vae))


def random_vae(cfg: VAEConfig, device: torch.device | str, seed: int) -> WanVAE:
    """The seeded random VAE; the condition and decode ranks draw the same one from the same seed."""
    vae = random_module(lambda: WanVAE(cfg), device, torch.float32, seed)
    assert isinstance(vae, WanVAE)
    vae.reset_latent_stats()
    return vae
