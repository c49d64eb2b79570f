"""The signal actions agree with their one declaration, types/signal-actions.json (from which the
gateway's own parser is generated): `ACTIONS`, the actions that need an edit distance, and one
session method per action, sync and async, each sending its own action."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Dict, List, Set

import pytest
from mock_provider import MockProvider

from nm_gateway import ACTIONS, AsyncSession, Gateway, InvalidSignal, Session
from nm_gateway._rules import EDIT_DISTANCE_REQUIRED
from nm_gateway._signals import build_signal

DECLARATION = Path(__file__).resolve().parents[3] / "types" / "signal-actions.json"
# Public methods of a session handle that are not one action each.
GENERAL_METHODS = {"signal", "run", "wrap"}


def declared() -> List[Dict[str, Any]]:
    actions: List[Dict[str, Any]] = json.loads(DECLARATION.read_text(encoding="utf-8"))["actions"]
    return actions


NAMES = [a["name"] for a in declared()]


def differences(what: str, copy: Set[str]) -> str:
    return f"{what}: missing {sorted(set(NAMES) - copy)}, not declared {sorted(copy - set(NAMES))}"


def test_actions_are_the_declared_ones_in_order() -> None:
    assert len(NAMES) >= 8
    assert set(ACTIONS) == set(NAMES), differences("ACTIONS", set(ACTIONS))
    assert list(ACTIONS) == NAMES


def test_edit_distance_is_required_exactly_for_the_declared_actions() -> None:
    required = {a["name"] for a in declared() if a["requires_edit_distance"]}
    assert required == EDIT_DISTANCE_REQUIRED
    for name in NAMES:
        if name in required:
            with pytest.raises(InvalidSignal) as e:
                build_signal("sess_1", name)
            assert e.value.code == "edit_distance_required"
        else:
            assert json.loads(build_signal("sess_1", name).body) == {"session_id": "sess_1", "action": name}


def action_methods(handle: type) -> Set[str]:
    """The public methods of a session handle that stand for one action each."""
    return {
        n
        for n, _ in inspect.getmembers(handle, inspect.isfunction)
        if not n.startswith("_") and n not in GENERAL_METHODS
    }


@pytest.mark.parametrize("handle", [Session, AsyncSession])
def test_one_session_method_per_action(handle: type) -> None:
    methods = action_methods(handle)
    assert methods == set(NAMES), differences(f"{handle.__name__}'s methods", methods)


def test_a_method_added_or_missing_is_seen() -> None:
    class Extra(Session):
        __slots__ = ()

        def not_an_action(self) -> None:
            """An action nobody declared."""

    assert action_methods(Extra) == {*NAMES, "not_an_action"}
    fewer = type("Fewer", (), {n: (lambda self: None) for n in NAMES[1:]})
    assert action_methods(fewer) == set(NAMES[1:])


def test_each_method_sends_its_action(gw: Gateway, fake: MockProvider) -> None:
    required = {a["name"] for a in declared() if a["requires_edit_distance"]}
    with gw.session() as s:
        for name in NAMES:
            kwargs = {"edit_distance": 3} if name in required else {}
            getattr(s, name)(**kwargs)
    assert [r.json()["action"] for r in fake.signals()] == NAMES


async def test_each_async_method_sends_its_action(gw: Gateway, fake: MockProvider) -> None:
    required = {a["name"] for a in declared() if a["requires_edit_distance"]}
    async with gw.session() as s:
        for name in NAMES:
            kwargs = {"edit_distance": 3} if name in required else {}
            await getattr(s, name)(**kwargs)
    assert [r.json()["action"] for r in fake.signals()] == NAMES
