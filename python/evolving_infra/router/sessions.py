"""Branches from the session headers that agent harnesses and gateways already send.

An agent should not have to be patched to send `X-Agent-Branch`: coding agents name their
session in headers of their own, and Dynamo documents them (its `dynamo-llm` 1.4.0,
`src/protocols/agents.rs`, and "Session IDs" in its user guide). When a request carries none of
the router's `X-Agent-*` headers and no body field `agent`, the first of these that is present
names its branch:

- Dynamo: branch `X-Dynamo-Session-ID` as is, parent `X-Dynamo-Parent-Session-ID` as is;
- Claude Code (S `X-Claude-Code-Session-Id`, A `X-Claude-Code-Agent-Id`, P
  `X-Claude-Code-Parent-Agent-Id`): branch `claude-code:S`, or `claude-code:S/A` for a
  sub-agent, whose parent is `claude-code:S/P`, else the session's `claude-code:S`;
- Codex: branch `codex:S` (S `Session-Id`), no parent;
- OpenCode: branch `opencode:S` (S `X-Session-Id`), parent `opencode:P` (P
  `X-Parent-Session-Id`).

Dynamo's canonical headers come first, as in Dynamo. The harness prefixes keep two harnesses'
ids apart. `X-Dynamo-Session-Final: true` ends the branch with the response (the `end` event).
A parent here is never a `fork`: a sub-agent starts its own context, so the parent is recorded
for logs and has no directory effect (`branches.py`). OpenAI's `user` is not a session (one user
runs many conversations at once), so it names no branch.
"""

from __future__ import annotations

from collections.abc import Mapping

from evolving_infra.router.branches import BranchEvent, BranchInfo, check_branch_id

DYNAMO_SESSION = "X-Dynamo-Session-ID"
DYNAMO_PARENT = "X-Dynamo-Parent-Session-ID"
DYNAMO_FINAL = "X-Dynamo-Session-Final"
CLAUDE_CODE_SESSION = "X-Claude-Code-Session-Id"
CLAUDE_CODE_AGENT = "X-Claude-Code-Agent-Id"
CLAUDE_CODE_PARENT_AGENT = "X-Claude-Code-Parent-Agent-Id"
CODEX_SESSION = "Session-Id"
OPENCODE_SESSION = "X-Session-Id"
OPENCODE_PARENT = "X-Parent-Session-Id"


def _get(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def session_branch(headers: Mapping[str, str]) -> BranchInfo | None:
    """The branch the session headers of `headers` name (the module's table), or None."""
    branch: str | None = None
    parent: str | None = None
    event: BranchEvent | None = None
    if session := _get(headers, DYNAMO_SESSION):
        branch, parent = session, _get(headers, DYNAMO_PARENT)
        if (_get(headers, DYNAMO_FINAL) or "").lower() == "true":
            event = BranchEvent.END
    elif session := _get(headers, CLAUDE_CODE_SESSION):
        root = f"claude-code:{session}"
        branch = root
        if agent := _get(headers, CLAUDE_CODE_AGENT):
            branch = f"{root}/{agent}"
            parent_agent = _get(headers, CLAUDE_CODE_PARENT_AGENT)
            parent = f"{root}/{parent_agent}" if parent_agent else root
    elif session := _get(headers, CODEX_SESSION):
        branch = f"codex:{session}"
    elif session := _get(headers, OPENCODE_SESSION):
        branch = f"opencode:{session}"
        if p := _get(headers, OPENCODE_PARENT):
            parent = f"opencode:{p}"
    if branch is None:
        return None
    check_branch_id(branch, "agent.branch")
    if parent is not None:
        check_branch_id(parent, "agent.parent")
        if parent == branch:
            parent = None  # a harness that names itself its own parent: no parent
    return BranchInfo(branch, parent, event)
