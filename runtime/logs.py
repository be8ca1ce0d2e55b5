"""One log format for every process: rank 0, the other ranks, the launcher, the router and the gateway.

Text (the default), one line per event::

    2026-12-02 01:40:22,123 rank0 INFO job=812 replica=a session=3f2a9c1b7d4e worldstream.core: session ... closed

``job`` (``WORLDSTREAM_JOB``, else Slurm's ``SLURM_JOB_ID``), ``replica`` (``replica.name``) and ``session`` appear
only where they apply. JSON (``--log-format json``, or ``WORLDSTREAM_LOG_FORMAT=json``): one object per line with
``time`` (ISO 8601, UTC), ``level``, ``role`` (``rank``, ``launcher``, ``router``, ``gateway``), ``rank`` (ranks
only), ``job``, ``replica``, ``session`` (where they apply), ``logger``, ``message`` and ``exception`` (a traceback,
when there is one).

The session is the record's ``session`` attribute when a call passes one (``extra={"session": sid}``), else the
first ``session ID`` (a hex id) the message names (the code's log lines say ``session %s ...``): no call site
changes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from datetime import datetime, timezone
from typing import Literal

Format = Literal["text", "json"]
FORMATS: tuple[Format, ...] = ("text", "json")
FORMAT_ENV = "WORLDSTREAM_LOG_FORMAT"
_SESSION = re.compile(r"\bsession ([0-9a-f]{8,32})\b")  # our session ids are hex ("a session costs" is not one)


def job_id() -> str:
    """The job this process belongs to: ``WORLDSTREAM_JOB``, else Slurm's job id; "" outside a job."""
    return os.environ.get("WORLDSTREAM_JOB") or os.environ.get("SLURM_JOB_ID", "")


def default_format() -> str:
    return os.environ.get(FORMAT_ENV, "text")


def session_of(record: logging.LogRecord) -> str:
    given = getattr(record, "session", None)
    if given:
        return str(given)
    found = _SESSION.search(record.getMessage())
    return found.group(1) if found else ""


class _Context:
    """Who logs: the role, the rank (ranks only), the job and the replica, fixed for the process."""

    def __init__(self, role: str, rank: int | None, job: str, replica: str) -> None:
        self.role, self.rank, self.job, self.replica = role, rank, job, replica

    @property
    def who(self) -> str:
        return f"rank{self.rank}" if self.rank is not None else self.role


class TextFormatter(logging.Formatter):
    def __init__(self, context: _Context) -> None:
        super().__init__("%(asctime)s %(who)s %(levelname)s %(where)s%(name)s: %(message)s")
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        c = self.context
        pairs = [("job", c.job), ("replica", c.replica), ("session", session_of(record))]
        record.who = c.who
        record.where = "".join(f"{k}={v} " for k, v in pairs if v)
        return super().format(record)


class JsonFormatter(logging.Formatter):
    def __init__(self, context: _Context) -> None:
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        c = self.context
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "role": c.role}
        if c.rank is not None:
            line["rank"] = c.rank
        for key, value in (("job", c.job), ("replica", c.replica), ("session", session_of(record))):
            if value:
                line[key] = value
        line["logger"] = record.name
        line["message"] = record.getMessage()
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(role: str, level: str = "INFO", fmt: str = "text", rank: int | None = None, replica: str = "",
              job: str | None = None) -> None:
    """Every log record of this process goes to stderr in ``fmt`` (replacing any handler set before)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    context = _Context(role, rank, job_id() if job is None else job, replica)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(context) if fmt == "json" else TextFormatter(context))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
