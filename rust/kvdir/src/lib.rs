//! The cluster-wide KV directory of evolving-infra (DESIGN §2).
//!
//! Which node holds which KV block in GPU memory (L1) and host memory (L2), how many live agent
//! branches need each block, when each holding was last used, and in which order each (node, tier)
//! should evict. Blocks are SGLang page hashes ([`block_hashes`]) forming a forest through their
//! parents, so engine events ([`Directory::apply_events`]) apply without translation.
//!
//! This crate is pure Rust; the Python module `evolving_infra._core` wraps it (`rust/kvdir-py`).

mod branches;
mod directory;
mod error;
pub mod events;
mod eviction;
mod hash;
mod holder_list;
mod holders;
mod invariants;
mod matching;
mod prompt;
pub mod scoring;
mod table;
mod wide;

pub use branches::BranchId;
pub use directory::{Directory, Stats};
pub use error::{Error, Result};
pub use hash::{block_hashes, common_prefix, trace_chain};
pub use matching::PrefixMatch;
pub use prompt::{PagedPrompt, Text as PromptText};

/// A block: its SGLang page hash, as a signed 64-bit int.
pub type BlockHash = i64;

/// An engine node. Below 2^31 - 1 so that a (node, tier) pair packs into one `u32` that leaves the
/// two largest values free (`holder_list` uses them as tags).
pub type NodeId = u32;

/// The largest node id the directory accepts: 2^31 - 2.
pub const MAX_NODE: NodeId = (1 << 31) - 2;

/// Where on a node a block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// GPU memory.
    L1 = 0,
    /// Host memory (the node's share of the pooled host cache).
    L2 = 1,
}

impl Tier {
    /// Both tiers, L1 first.
    pub const ALL: [Tier; 2] = [Tier::L1, Tier::L2];

    /// `"L1"` or `"L2"`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::L1 => "L1",
            Tier::L2 => "L2",
        }
    }
}

impl std::str::FromStr for Tier {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "L1" => Ok(Tier::L1),
            "L2" => Ok(Tier::L2),
            _ => Err(Error::invalid(
                "tier",
                format!("{s:?} is not \"L1\" or \"L2\""),
            )),
        }
    }
}

/// A (node, tier) pair packed as `node << 1 | tier`: sorting places groups a node's two tiers,
/// which is what `match` walks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Place(u32);

impl Place {
    pub(crate) fn new(node: NodeId, tier: Tier) -> Self {
        debug_assert!(node <= MAX_NODE);
        Place(node << 1 | tier as u32)
    }

    pub(crate) fn raw(self) -> u32 {
        self.0
    }

    /// The raw value below every place of `node` and above every place of lower nodes: where
    /// the node's entries start in a list sorted by place.
    pub(crate) fn node_start(node: NodeId) -> u32 {
        node << 1
    }

    pub(crate) fn node(self) -> NodeId {
        self.0 >> 1
    }

    pub(crate) fn tier(self) -> Tier {
        if self.0 & 1 == 0 {
            Tier::L1
        } else {
            Tier::L2
        }
    }
}

/// Checks a node id from outside (bindings take wider ints).
pub fn check_node(node: i64) -> Result<NodeId> {
    u32::try_from(node)
        .ok()
        .filter(|&n| n <= MAX_NODE)
        .ok_or_else(|| Error::invalid("node", format!("{node} is not in [0, 2^31 - 1)")))
}

/// Checks a time: finite seconds.
pub fn check_time(now: f64) -> Result<f64> {
    if now.is_finite() {
        // -0.0 and 0.0 must order equally in the eviction index.
        Ok(now + 0.0)
    } else {
        Err(Error::invalid(
            "now",
            format!("{now} is not a finite number of seconds"),
        ))
    }
}
