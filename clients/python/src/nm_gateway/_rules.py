"""The gateway's rules for the values a client sends, checked before anything is sent.

The same rules as the gateway's own parsers (nm-types and the signal endpoint), so a value
this module accepts is never refused by the gateway, and a refused one gets a clear error
naming the rule at the line that made it, instead of a 400 later.
"""

from __future__ import annotations

import re
import uuid
from typing import FrozenSet, Optional, Tuple

from ._errors import ConfigError

# The signal actions as declared in types/signal-actions.json (the one declaration, from which the
# gateway's own parser is generated); tests/test_actions.py checks these two and the session
# methods (one per action) against it.
ACTIONS: Tuple[str, ...] = (
    "accepted",
    "edited",
    "regenerated",
    "abandoned",
    "thumbs_up",
    "thumbs_down",
    "published",
    "sent",
)
# The actions a signal must carry edit_distance with.
EDIT_DISTANCE_REQUIRED: FrozenSet[str] = frozenset({"edited"})
ENVS: Tuple[str, ...] = ("production", "staging", "development")

MAX_SESSION_ID_LEN = 128  # the <id> part of sess_<id>
MAX_AGENT_LEN = 128
MAX_USER_LEN = 256
MAX_IDEMPOTENCY_KEY_LEN = 255
MAX_CUSTOM_LABEL_BYTES = 1024
MAX_EDIT_DISTANCE = 2**64 - 1  # the gateway stores it as u64

_SESSION_RE = re.compile(rf"sess_[A-Za-z0-9_-]{{1,{MAX_SESSION_ID_LEN}}}")
# Header values the gateway reads must be visible ASCII (space allowed inside).
_PRINTABLE_RE = re.compile(r"[\x20-\x7e]+")

# A request id (an answer's NM-Request-Id): a UUIDv7 in lowercase hyphenated form, as the gateway
# writes it and as its signal endpoint requires it.
_REQUEST_ID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
REQUEST_ID_RULE = (
    "request_id must be an NM-Request-Id value: a UUIDv7 in lowercase hyphenated form "
    "(36 characters, e.g. 01890a5d-ac96-774b-bcce-b302099a8057)"
)


def is_request_id(value: object) -> bool:
    return isinstance(value, str) and _REQUEST_ID_RE.fullmatch(value) is not None


SESSION_RULE = "a session id is sess_<id>, where <id> is 1 to 128 characters of A-Z, a-z, 0-9, '_' or '-'"


def new_session_id() -> str:
    """A fresh session id: `sess_` and 32 hex digits of a random UUID."""
    return "sess_" + uuid.uuid4().hex


def is_session_id(value: object) -> bool:
    return isinstance(value, str) and _SESSION_RE.fullmatch(value) is not None


def printable(value: object, max_len: int) -> bool:
    """1..max_len visible ASCII characters, not blank, no surrounding whitespace."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= max_len
        and value.strip() == value
        and _PRINTABLE_RE.fullmatch(value) is not None
    )


def check_agent(value: Optional[str], where: str) -> Optional[str]:
    if value is None:
        return None
    if not printable(value, MAX_AGENT_LEN):
        raise ConfigError(
            f"{where}: an agent name is 1 to {MAX_AGENT_LEN} visible ASCII characters, "
            f"without surrounding spaces; got {value!r}"
        )
    return value


def check_user(value: Optional[str], where: str) -> Optional[str]:
    if value is None:
        return None
    if not printable(value, MAX_USER_LEN):
        raise ConfigError(
            f"{where}: an end-user id is 1 to {MAX_USER_LEN} visible ASCII characters, "
            f"without surrounding spaces; got {value!r}"
        )
    return value


def check_env(value: Optional[str], where: str) -> Optional[str]:
    if value is None:
        return None
    if value not in ENVS:
        raise ConfigError(f"{where}: env must be one of {', '.join(ENVS)}; got {value!r}")
    return value


def check_session_id(value: Optional[str], where: str) -> Optional[str]:
    if value is None:
        return None
    if not is_session_id(value):
        raise ConfigError(f"{where}: {SESSION_RULE}; got {value!r}")
    return value
