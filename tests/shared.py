"""The flags of the session-wide shared server (``tests/conftest.py``), for the tests that check its limits; how a
test reads a server's messages on a bare socket (``read_server``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from ipc import chunk_wire, protocol
from scripts.ports import free_port

CLIENT_TIMEOUT_S = 2.0
MAX_SESSIONS = 4
MAX_CHUNKS = 500
MAX_IMAGE_PIXELS = 65536
FAST = ["--synthetic.encode_s=0.01", "--synthetic.denoise_s=0.03", "--synthetic.decode_s=0.015"]
SHARED_FLAGS = [*FAST, "--model.kind=tests.faulty_backend:build", f"--server.client_timeout_s={CLIENT_TIMEOUT_S}",
                f"--server.max_sessions={MAX_SESSIONS}",
                f"--server.max_chunks={MAX_CHUNKS}", f"--server.max_image_pixels={MAX_IMAGE_PIXELS}",
                "--server.send_hwm=4"]  # fmt: skip


def shared_flags() -> list[str]:
    """The shared server's flags, with a Prometheus port drawn when it starts (a port drawn earlier may be taken
    by then)."""
    return [*SHARED_FLAGS, f"--metrics.prometheus_port={free_port()}"]


def prometheus_port(server: Any) -> int:
    """The Prometheus port a ``LocalServer`` was started with (its ``--metrics.prometheus_port`` flag)."""
    flag = "--metrics.prometheus_port="
    return int(next(arg for arg in reversed(server.overrides) if arg.startswith(flag))[len(flag):])


def read_server(sock: zmq.Socket, decode: Callable[..., Any] = protocol.decode) -> Any:
    """One message a server (or router) sent ``sock``, decoded as the SDK reads it: a chunk's frames part (protocol
    4) checked against its map, never decoded into it; any other message one part."""
    parts = sock.recv_multipart(copy=False)
    message = decode(parts[0].buffer, "server", max_bytes=1 << 31)
    if isinstance(message, protocol.Chunk):
        chunk_wire.frames_of(message, parts)
    else:
        chunk_wire.one_message(parts, type(message).__name__)
    return message


def tiny_model_stages(image_png: bytes) -> tuple:
    """The cpu-tiny-model config, its three real stages in this process, and ``image_png`` as the uint8
    ``[H, W, 3]`` tensor a condition stage opens with: the one-process reference the 7-rank tests compare against."""
    import torch

    from models import lingbot
    from runtime import config as config_mod
    from runtime.images import decode_image

    cfg = config_mod.load("cpu-tiny-model")
    device = torch.device("cpu")
    stages = (lingbot.build_condition(cfg.model, cfg.stream, device),
              lingbot.build_denoise(cfg.model, cfg.stream, cfg.controls, device, None),
              lingbot.build_decode(cfg.model, cfg.stream, device))  # fmt: skip
    raw = decode_image(image_png, cfg.server.max_image_pixels)
    image = torch.frombuffer(bytearray(raw.pixels), dtype=torch.uint8).view(raw.height, raw.width, 3)
    return (cfg, *stages, image)
