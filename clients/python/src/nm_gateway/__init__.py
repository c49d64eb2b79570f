"""nm-gateway client: the official provider SDKs pre-wired to the gateway, sessions set
automatically, signals in one line.

    from nm_gateway import Gateway

    gw = Gateway(agent="support-bot")          # NM_GATEWAY_URL, NM_KEY, NM_ENV from the environment
    client = gw.openai()                        # an openai.OpenAI, through the gateway
    with gw.session(user="user-7") as s:        # NM-Session + NM-User on every request inside
        client.chat.completions.create(model="gpt-4o-mini", messages=[...])
        s.accepted()                            # POST /v1/signal, idempotent, retried
"""

from ._edit import edit_distance
from ._errors import (
    ConfigError,
    InvalidSignal,
    NMGatewayError,
    SignalError,
    error_code,
    request_id,
)
from ._gateway import PROVIDER_KEY_PLACEHOLDER, Gateway
from ._rules import ACTIONS, ENVS, new_session_id
from ._session import LAST_ANSWER, AsyncSession, LastAnswer, Session, SessionScope, current_session
from ._signals import SignalStats

__version__ = "0.1.0"

__all__ = [
    "ACTIONS",
    "ENVS",
    "LAST_ANSWER",
    "PROVIDER_KEY_PLACEHOLDER",
    "AsyncSession",
    "ConfigError",
    "Gateway",
    "InvalidSignal",
    "LastAnswer",
    "NMGatewayError",
    "Session",
    "SessionScope",
    "SignalError",
    "SignalStats",
    "current_session",
    "edit_distance",
    "error_code",
    "new_session_id",
    "request_id",
]
