"""``ipc.error_codes.ErrorCode`` is the one list of error codes: every code the server, the router, the gateway and
the SDK can send or raise is a member, every code the play page names is one, the SDK has an error class for each
(or answers it with the base class, as documented), and a member goes on the wire as its plain string."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from ipc import protocol
from ipc.client_errors import _ERROR_TYPES, BASE_CLASS_CODES, ServerError, SessionMigrated
from ipc.error_codes import ErrorCode
from web import page_messages as pm

ROOT = Path(__file__).resolve().parents[1]
# where a code is written: the exceptions and calls that carry one, and the ``code=`` of an ``error`` message
_RAISED = re.compile(r'(?:ClientError|PageError|InputStateError|ControlStateError|BadRequest|ServerGone|'
                     r'ServerError\.of|self\.error|notices)\(\s*"(\w+)"')
_FIELD = re.compile(r'\bcode="(\w+)"')
_MEMBER = re.compile(r"\bErrorCode\.([A-Z_]+)\b")


def _sources() -> list[Path]:
    return [path for floor in ("ipc", "runtime", "web", "ranks", "router") for path in (ROOT / floor).rglob("*.py")]


def test_every_code_written_where_an_error_is_made_is_a_member() -> None:
    written: dict[str, str] = {}
    for path in _sources():
        text = path.read_text()
        for code in [*_RAISED.findall(text), *_FIELD.findall(text)]:
            written.setdefault(code, str(path.relative_to(ROOT)))
        for name in _MEMBER.findall(text):
            assert name in ErrorCode.__members__, f"{path.relative_to(ROOT)} names ErrorCode.{name}, no member"
    unknown = {code: where for code, where in written.items() if code not in set(ErrorCode)}
    assert not unknown, f"error codes that are no ErrorCode member: {unknown}"


def test_every_code_the_play_page_names_is_a_member() -> None:
    js = (ROOT / "web" / "static" / "play.js").read_text()
    worded = set(re.findall(r"^  (\w+): \(e\) =>", js, re.M))  # the page's own wording per code
    compared = set(re.findall(r"""\.code\s*[!=]==?\s*["'](\w+)["']""", js))
    assert worded and compared, "play.js no longer words or compares codes this way: update this test"
    assert (worded | compared) <= set(ErrorCode), sorted((worded | compared) - set(ErrorCode))


def test_every_code_the_gateway_explains_to_the_page_is_a_member() -> None:
    assert all(type(code) is ErrorCode for code in pm.ERROR_CODES)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_the_sdk_has_an_error_class_for_each_code_or_answers_it_with_the_base_class(code: ErrorCode) -> None:
    own = _ERROR_TYPES.get(code) or (SessionMigrated if code in SessionMigrated.codes else None)
    assert own is not None or code in BASE_CLASS_CODES, f"{code}: no class and not in BASE_CLASS_CODES"
    error = ServerError.of(str(code), "why")  # as read from the wire: a plain string
    assert type(error) is (_ERROR_TYPES.get(code) or ServerError) and error.code == code


def test_every_sdk_error_class_stands_for_members_only() -> None:
    def classes(cls: type[ServerError]) -> list[type[ServerError]]:
        return [cls, *(c for sub in cls.__subclasses__() for c in classes(sub))]

    for cls in classes(ServerError):
        assert all(type(code) is ErrorCode for code in cls.codes), cls.__name__


def test_a_member_goes_on_the_wire_as_its_string_and_reads_back_equal() -> None:
    as_member = protocol.encode(protocol.Error(req=1, session="s", code=ErrorCode.BUSY, message="full"))
    assert as_member == protocol.encode(protocol.Error(req=1, session="s", code="busy", message="full"))
    decoded = msgspec.msgpack.decode(as_member, type=protocol.Error)
    assert type(decoded.code) is str and decoded.code == ErrorCode.BUSY
    assert pm.encode(pm.Error(code=ErrorCode.BUSY, message="full")) == pm.encode(pm.Error(code="busy", message="full"))
