//! Errors of the directory. Every variant is raised *before* any change, so a call that returns
//! an error leaves the directory exactly as it was (DESIGN §2, "atomic and validated").

use crate::BlockHash;

/// Why a directory call was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// `parent` is not a block the directory knows.
    #[error("unknown parent block {parent}")]
    UnknownParent {
        /// The parent hash given by the caller.
        parent: BlockHash,
    },
    /// `hash` is known under `known_parent`, but the call puts it under `parent`.
    #[error("block {hash} is known under parent {known_parent:?}, not {parent:?}")]
    ParentMismatch {
        /// The block whose parent disagrees.
        hash: BlockHash,
        /// The parent the call implies (`None`: a first page).
        parent: Option<BlockHash>,
        /// The parent the directory has recorded.
        known_parent: Option<BlockHash>,
    },
    /// A chain repeats `hash`, or contains its own parent.
    #[error("chain repeats block {hash}")]
    DuplicateHash {
        /// The repeated hash.
        hash: BlockHash,
    },
    /// A value that is not a signed 64-bit block hash (raised by bindings that see wider ints).
    #[error("{value} is outside the signed 64-bit range of block hashes")]
    HashRange {
        /// The offending value, as text (it does not fit an `i64`).
        value: String,
    },
    /// `branch_fork` from a branch that does not exist.
    #[error("unknown branch {branch}")]
    UnknownBranch {
        /// The branch, as the caller named it.
        branch: String,
    },
    /// `branch_fork` onto a branch that already exists.
    #[error("branch {branch} already exists")]
    BranchExists {
        /// The branch, as the caller named it.
        branch: String,
    },
    /// A bad tier, node, time, page size or count.
    #[error("invalid {argument}: {reason}")]
    InvalidArgument {
        /// The parameter's name.
        argument: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// Bytes that are not a valid SGLang `KVEventBatch`.
    #[error("bad KV event bytes at offset {offset}: {reason}")]
    EventDecode {
        /// Byte offset where decoding stopped.
        offset: usize,
        /// What was expected there.
        reason: String,
    },
}

/// Result alias of the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn invalid(argument: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            argument,
            reason: reason.into(),
        }
    }
}
