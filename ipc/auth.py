"""The client port's access token: where a server, a router or a client finds it (a file or an environment
variable, never the command line, where every user of the node reads it in ``ps``), whether a bind address needs
one, and the constant-time check of the one a request carries (its ``auth`` field).

Torch-free: the SDK and the operator command use it as the server does.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import os
from pathlib import Path

from msgspec import UnsetType

log = logging.getLogger(__name__)

TOKEN_ENV = "WORLDSTREAM_TOKEN"  # the SDK's and ctl's default: the token itself
TOKEN_FILE_ENV = "WORLDSTREAM_TOKEN_FILE"  # ... or a file holding it
MAX_TOKEN_CHARS = 256  # the ``auth`` field's bound (``ipc.schemas``): a token is a short random string

REFUSAL_MESSAGE = "unauthorized"


class TokenError(ValueError):
    """A token that was named (a file, a variable) but cannot be read, is empty or too long."""


def read_token(file: str = "", env: str = "", what: str = "token") -> str | None:
    """The token in ``file`` (surrounding whitespace dropped), else in the environment variable ``env``; None when
    neither is named. One that is named but missing or empty is a ``TokenError`` naming it (never a silent
    downgrade to no token)."""
    if file:
        try:
            token = Path(file).read_text().strip()
            if Path(file).stat().st_mode & 0o077:  # a secret others on the host can read is no secret
                log.warning("%s: %s is readable by others than its owner: chmod 600 it", what, file)
        except OSError as error:
            raise TokenError(f"{what}: cannot read {file}: {error.strerror}") from None
        source = file
    elif env:
        token = os.environ.get(env, "").strip()
        source = f"${env}"
    else:
        return None
    if not token:
        raise TokenError(f"{what}: {source} is empty")
    if len(token) > MAX_TOKEN_CHARS or not token.isprintable():
        raise TokenError(f"{what}: {source} must be at most {MAX_TOKEN_CHARS} printable characters")
    return token


def client_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The token a client presents: ``token``, else the one in ``token_file``, else ``$WORLDSTREAM_TOKEN``, else the
    file ``$WORLDSTREAM_TOKEN_FILE`` names; None: it presents none (a loopback server needs none)."""
    if token:
        return token
    if token_file:
        return read_token(token_file, what="client token file")
    if os.environ.get(TOKEN_ENV):
        return read_token(env=TOKEN_ENV, what="client token")
    return read_token(os.environ.get(TOKEN_FILE_ENV, ""), what=f"${TOKEN_FILE_ENV}")


def accepts(expected: str | None, given: str | UnsetType) -> bool:
    """Whether a request carrying ``given`` may go on: always when no token is required. Both sides are hashed
    first, so ``compare_digest`` compares equal lengths and the time taken says nothing about the token's length
    or where a wrong one differs."""
    if expected is None:
        return True
    if not isinstance(given, str):
        given = ""
    return hmac.compare_digest(_digest(expected), hashlib.sha256(given.encode()).digest())


@functools.lru_cache(maxsize=8)
def _digest(token: str) -> bytes:
    """A configured token's digest, made once (a server or router holds one or two), not on every request."""
    return hashlib.sha256(token.encode()).digest()


def is_loopback(host: str) -> bool:
    """Whether only this host reaches a server bound to ``host`` (an address or a name, no port)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:  # an address; any other name (``127.example.net`` too) may resolve beyond this host
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_problem(host: str, key: str, named: bool, insecure: bool, insecure_key: str) -> str | None:
    """Why a client port bound to ``host`` must not start: beyond loopback with no token named and no explicit
    ``insecure``; None when it may."""
    if named or insecure or is_loopback(host):
        return None
    return (f"the client port binds to {host}, beyond loopback, with no client token: set {key} (a file holding a "
            f"random secret, e.g. `openssl rand -hex 32 > token && chmod 600 token`) or, if anyone who reaches the "
            f"port may open sessions, {insecure_key} = true")
