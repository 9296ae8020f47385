"""Agent workloads: trace formats and the requests they describe (knows no simulator).

For now one importer: real Claude Code sessions (`claude_code`). The full trace model
(sessions, branches, timing, generators, stats) grows here.
"""

from evolving_infra.workloads.claude_code import (
    BLOCK_SIZE,
    BlockHash,
    BranchId,
    Conversation,
    ConversationId,
    Request,
    TraceFormatError,
    bundled_trace_dir,
    chain_hashes,
    find_trace_files,
    load_conversation,
    load_conversations,
    merge_by_time,
)

__all__ = [
    "BLOCK_SIZE",
    "BlockHash",
    "BranchId",
    "Conversation",
    "ConversationId",
    "Request",
    "TraceFormatError",
    "bundled_trace_dir",
    "chain_hashes",
    "find_trace_files",
    "load_conversation",
    "load_conversations",
    "merge_by_time",
]
