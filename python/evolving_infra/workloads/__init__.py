"""Agent workloads: the trace model, its file format, importers, generators and statistics.

Knows no simulator. `model` defines agents, branches and requests; `jsonl` the versioned file
format; `importers` turns real traces (Claude Code, Mooncake) into the model; `claude_code` reads
the raw Claude Code format; `blocks` gives the directory hashes of a trace's prompts; `timeline`
the nominal replay order; `generators/` the seeded synthetic workloads; `sampling` N concurrent
agents drawn from a trace set; `stats` the statistics and h*; `command` the `trace` CLI.
"""

from evolving_infra.types import BlockHash
from evolving_infra.workloads.blocks import PromptHasher, chain_hashes
from evolving_infra.workloads.claude_code import (
    BLOCK_SIZE,
    CcRequest,
    Conversation,
    ConversationId,
    SubAgent,
    bundled_trace_dir,
    find_trace_files,
    load_conversation,
    load_conversations,
    merge_by_time,
)
from evolving_infra.workloads.errors import TraceFormatError
from evolving_infra.workloads.importers import claude_code_trace, mooncake_trace
from evolving_infra.workloads.jsonl import load as load_trace
from evolving_infra.workloads.jsonl import save as save_trace
from evolving_infra.workloads.model import (
    Agent,
    AgentId,
    BlockId,
    BlockIds,
    Branch,
    BranchId,
    BranchKind,
    Request,
    Trace,
    TraceError,
    validate,
)

__all__ = [
    "BLOCK_SIZE",
    "Agent",
    "AgentId",
    "BlockHash",
    "BlockId",
    "BlockIds",
    "Branch",
    "BranchId",
    "BranchKind",
    "CcRequest",
    "Conversation",
    "ConversationId",
    "PromptHasher",
    "Request",
    "SubAgent",
    "Trace",
    "TraceError",
    "TraceFormatError",
    "bundled_trace_dir",
    "chain_hashes",
    "claude_code_trace",
    "find_trace_files",
    "load_conversation",
    "load_conversations",
    "load_trace",
    "merge_by_time",
    "mooncake_trace",
    "save_trace",
    "validate",
]
