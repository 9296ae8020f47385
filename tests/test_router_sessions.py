"""Unmodified harnesses (issue 27): the session headers that coding agents and Dynamo's clients
already send name the request's branch, as `router.sessions` documents; the router's own
`X-Agent-*` headers win when both are present."""

from __future__ import annotations

import pytest

from evolving_infra.router import api
from evolving_infra.router.branches import BranchEvent, BranchInfo
from evolving_infra.router.sessions import session_branch
from router_helpers import Router, run_router


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"X-Dynamo-Session-ID": "run-42:researcher"}, BranchInfo("run-42:researcher")),
        (
            {"X-Dynamo-Session-ID": "c", "X-Dynamo-Parent-Session-ID": "p"},
            BranchInfo("c", "p"),
        ),
        (
            {"X-Dynamo-Session-ID": "c", "X-Dynamo-Session-Final": "TRUE"},
            BranchInfo("c", None, BranchEvent.END),
        ),
        ({"X-Claude-Code-Session-Id": "s1"}, BranchInfo("claude-code:s1")),
        (
            {"X-Claude-Code-Session-Id": "s1", "X-Claude-Code-Agent-Id": "a2"},
            BranchInfo("claude-code:s1/a2", "claude-code:s1"),
        ),
        (
            {
                "X-Claude-Code-Session-Id": "s1",
                "X-Claude-Code-Agent-Id": "a3",
                "X-Claude-Code-Parent-Agent-Id": "a2",
            },
            BranchInfo("claude-code:s1/a3", "claude-code:s1/a2"),
        ),
        ({"Session-Id": "0199-abc"}, BranchInfo("codex:0199-abc")),
        (
            {"X-Session-Id": "ses_b", "X-Parent-Session-Id": "ses_a"},
            BranchInfo("opencode:ses_b", "opencode:ses_a"),
        ),
        # Dynamo's canonical headers win over an agent's own, as in Dynamo.
        (
            {"X-Dynamo-Session-ID": "canon", "X-Claude-Code-Session-Id": "s1"},
            BranchInfo("canon"),
        ),
        ({"X-Session-Id": "  "}, None),  # blank: no session
    ],
)
def test_session_headers_name_the_branch(
    headers: dict[str, str], expected: BranchInfo | None
) -> None:
    assert session_branch(headers) == expected


def test_a_session_id_that_is_no_branch_id_is_a_400() -> None:
    with pytest.raises(api.ApiError) as e:
        session_branch({"X-Session-Id": "x" * 300})
    assert e.value.status == 400


def test_the_router_tracks_sessions_and_its_own_headers_win() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "read the repository"}]}

    async def test(r: Router) -> None:
        claude = {"X-Claude-Code-Session-Id": "s1", "X-Claude-Code-Agent-Id": "explore"}
        assert (
            await r.client.post("/v1/chat/completions", json=chat, headers=claude)
        ).status == 200
        assert "claude-code:s1/explore" in r.tracker
        ours = {"X-Agent-Branch": "mine", "X-Session-Id": "theirs"}
        assert (await r.client.post("/v1/chat/completions", json=chat, headers=ours)).status == 200
        assert "mine" in r.tracker
        assert "opencode:theirs" not in r.tracker
        final = {"X-Dynamo-Session-ID": "d1", "X-Dynamo-Session-Final": "true"}
        assert (await r.client.post("/v1/chat/completions", json=chat, headers=final)).status == 200
        assert "d1" not in r.tracker  # ended with its response
        seen = [req.branch_info for req in r.dispatcher.seen]
        assert seen[0] == BranchInfo("claude-code:s1/explore", "claude-code:s1")

    run_router(test)
