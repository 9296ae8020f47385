//! Decoding of SGLang `KVEventBatch` payloads (msgpack), both encodings (DESIGN §4):
//!
//! - tagged maps, SGLang ≥ 0.5.20: `[ts, [{"type": "BlockStored", "block_hashes": [...],
//!   "parent_block_hash": p, "token_ids": [...], "block_size": n, "lora_id": nil,
//!   "medium": "GPU", ...}, ...], attn_dp_rank]`;
//! - positional arrays, SGLang ≤ 0.5.16: `["BlockStored", hashes, parent, token_ids, block_size,
//!   lora_id, medium?, ...]`, `["BlockRemoved", hashes, medium?]`, `["AllBlocksCleared"]`.
//!
//! Unknown keys, trailing fields and unknown event types are skipped (schema churn must not break
//! ingestion: Dynamo's PR #3180, issue #10660). Hashes may be encoded signed or unsigned; an
//! unsigned value ≥ 2^63 is read as its two's-complement `i64`. The decoder is a small cursor over
//! the bytes (no intermediate value tree) with a nesting limit, so hostile input cannot blow the
//! stack, and every error carries the offset where it stopped.

use crate::{BlockHash, Error, Result, Tier};

/// One decoded event, with its medium already mapped to a tier (`None`: not a directory tier).
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// `BlockStored`: the node now holds `hashes` as a chain under `parent`.
    Stored {
        /// The chain, first page first.
        hashes: Vec<BlockHash>,
        /// The parent of `hashes[0]` (`None`: a first page).
        parent: Option<BlockHash>,
        /// `None` when the medium is DISK, EXTERNAL or unknown: the event is skipped.
        tier: Option<Tier>,
    },
    /// `BlockRemoved`: the node no longer holds `hashes`.
    Removed {
        /// The blocks removed.
        hashes: Vec<BlockHash>,
        /// As for `Stored`.
        tier: Option<Tier>,
    },
    /// `AllBlocksCleared`: the node holds nothing any more.
    Cleared,
    /// An event type this decoder does not know (skipped, counted).
    Unknown,
}

/// A decoded batch: `[ts, events, dp_rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The engine's timestamp (seconds), if it sent a number.
    pub ts: Option<f64>,
    /// The events, in order.
    pub events: Vec<Event>,
    /// The attention data-parallel rank, if any.
    pub dp_rank: Option<i64>,
}

/// Maps SGLang's `StorageMedium` (and vLLM's) to a directory tier.
fn tier_of_medium(medium: Option<&str>) -> Option<Tier> {
    match medium {
        None | Some("GPU") => Some(Tier::L1),
        Some("CPU" | "CPU_PINNED") => Some(Tier::L2),
        // DISK, EXTERNAL and media we do not know are not tiers of the directory.
        Some(_) => None,
    }
}

const MAX_DEPTH: usize = 32;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

enum Int {
    Signed(i64),
    Unsigned(u64),
}

impl<'a> Cursor<'a> {
    fn err(&self, reason: impl Into<String>) -> Error {
        Error::EventDecode {
            offset: self.pos,
            reason: reason.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err(format!("truncated: {n} more bytes expected"))),
        }
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("take returns N bytes"))
    }

    fn peek(&self) -> Result<u8> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| self.err("truncated: value expected"))
    }

    fn len_of(&mut self, n: usize) -> Result<usize> {
        Ok(match n {
            1 => usize::from(self.u8()?),
            2 => usize::from(u16::from_be_bytes(self.be()?)),
            _ => u32::from_be_bytes(self.be()?) as usize,
        })
    }

    /// Reads an array header; `None` if the next value is not an array.
    fn array_len(&mut self) -> Result<Option<usize>> {
        let m = self.peek()?;
        let n = match m {
            0x90..=0x9f => {
                self.pos += 1;
                usize::from(m & 0x0f)
            }
            0xdc => {
                self.pos += 1;
                self.len_of(2)?
            }
            0xdd => {
                self.pos += 1;
                self.len_of(4)?
            }
            _ => return Ok(None),
        };
        // Every element takes at least one byte: a length beyond the buffer is corrupt.
        if n > self.buf.len() - self.pos {
            return Err(self.err(format!("array of {n} elements exceeds the payload")));
        }
        Ok(Some(n))
    }

    fn map_len(&mut self) -> Result<Option<usize>> {
        let m = self.peek()?;
        let n = match m {
            0x80..=0x8f => {
                self.pos += 1;
                usize::from(m & 0x0f)
            }
            0xde => {
                self.pos += 1;
                self.len_of(2)?
            }
            0xdf => {
                self.pos += 1;
                self.len_of(4)?
            }
            _ => return Ok(None),
        };
        if n.saturating_mul(2) > self.buf.len() - self.pos {
            return Err(self.err(format!("map of {n} entries exceeds the payload")));
        }
        Ok(Some(n))
    }

    fn is_nil(&mut self) -> Result<bool> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn str(&mut self) -> Result<&'a str> {
        let start = self.pos;
        let m = self.u8()?;
        let n = match m {
            0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => self.len_of(1)?,
            0xda => self.len_of(2)?,
            0xdb => self.len_of(4)?,
            _ => {
                self.pos = start;
                return Err(self.err(format!("string expected, found marker 0x{m:02x}")));
            }
        };
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes).map_err(|_| Error::EventDecode {
            offset: start,
            reason: "string is not UTF-8".into(),
        })
    }

    fn int(&mut self) -> Result<Int> {
        let start = self.pos;
        let m = self.u8()?;
        Ok(match m {
            0x00..=0x7f => Int::Unsigned(u64::from(m)),
            0xe0..=0xff => Int::Signed(i64::from(m as i8)),
            0xcc => Int::Unsigned(u64::from(self.u8()?)),
            0xcd => Int::Unsigned(u64::from(u16::from_be_bytes(self.be()?))),
            0xce => Int::Unsigned(u64::from(u32::from_be_bytes(self.be()?))),
            0xcf => Int::Unsigned(u64::from_be_bytes(self.be()?)),
            0xd0 => Int::Signed(i64::from(self.u8()? as i8)),
            0xd1 => Int::Signed(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => Int::Signed(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => Int::Signed(i64::from_be_bytes(self.be()?)),
            _ => {
                self.pos = start;
                return Err(self.err(format!("integer expected, found marker 0x{m:02x}")));
            }
        })
    }

    fn hash(&mut self) -> Result<BlockHash> {
        Ok(match self.int()? {
            Int::Signed(v) => v,
            // SGLang sends signed int64; vLLM-style unsigned hashes map to the same 64 bits.
            Int::Unsigned(v) => v as i64,
        })
    }

    fn opt_hash(&mut self) -> Result<Option<BlockHash>> {
        if self.is_nil()? {
            Ok(None)
        } else {
            self.hash().map(Some)
        }
    }

    fn hashes(&mut self) -> Result<Vec<BlockHash>> {
        let Some(n) = self.array_len()? else {
            return Err(self.err("array of block hashes expected"));
        };
        (0..n).map(|_| self.hash()).collect()
    }

    fn opt_str(&mut self) -> Result<Option<&'a str>> {
        if self.is_nil()? {
            Ok(None)
        } else {
            self.str().map(Some)
        }
    }

    fn number(&mut self) -> Result<Option<f64>> {
        let m = self.peek()?;
        Ok(match m {
            0xc0 => {
                self.pos += 1;
                None
            }
            0xca => {
                self.pos += 1;
                Some(f64::from(f32::from_be_bytes(self.be()?)))
            }
            0xcb => {
                self.pos += 1;
                Some(f64::from_be_bytes(self.be()?))
            }
            _ => match self.int()? {
                Int::Signed(v) => Some(v as f64),
                Int::Unsigned(v) => Some(v as f64),
            },
        })
    }

    /// Skips one value of any type (unknown keys, trailing fields).
    fn skip(&mut self, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(self.err("values nested too deeply"));
        }
        let m = self.peek()?;
        match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => self.pos += 1,
            0xcc..=0xd3 => {
                self.int()?;
            }
            0xca => {
                self.pos += 1;
                self.take(4)?;
            }
            0xcb => {
                self.pos += 1;
                self.take(8)?;
            }
            0xa0..=0xbf | 0xd9..=0xdb => {
                self.str()?;
            }
            0xc4..=0xc6 => {
                self.pos += 1;
                let n = self.len_of(1 << (m - 0xc4))?;
                self.take(n)?;
            }
            0xd4..=0xd8 => {
                self.pos += 1;
                self.take(1 + (1 << (m - 0xd4)))?;
            }
            0xc7..=0xc9 => {
                self.pos += 1;
                let n = self.len_of(1 << (m - 0xc7))?;
                self.take(1 + n)?;
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                let n = self.array_len()?.expect("marker is an array");
                for _ in 0..n {
                    // Token-id arrays (thousands of ints per event) are most of a batch's bytes:
                    // step over plain ints without the general path.
                    let width = match self.buf.get(self.pos) {
                        Some(0x00..=0x7f | 0xe0..=0xff) => 1,
                        Some(0xcc | 0xd0) => 2,
                        Some(0xcd | 0xd1) => 3,
                        Some(0xce | 0xd2) => 5,
                        Some(0xcf | 0xd3) => 9,
                        _ => 0,
                    };
                    if width > 0 && self.pos + width <= self.buf.len() {
                        self.pos += width;
                    } else {
                        self.skip(depth + 1)?;
                    }
                }
            }
            0x80..=0x8f | 0xde | 0xdf => {
                let n = self.map_len()?.expect("marker is a map");
                for _ in 0..2 * n {
                    self.skip(depth + 1)?;
                }
            }
            0xc1 => return Err(self.err("reserved marker 0xc1")),
        }
        Ok(())
    }

    fn event(&mut self) -> Result<Event> {
        if let Some(n) = self.map_len()? {
            self.map_event(n)
        } else if let Some(n) = self.array_len()? {
            self.positional_event(n)
        } else {
            Err(self.err("event must be a map or an array"))
        }
    }

    fn map_event(&mut self, n: usize) -> Result<Event> {
        let start = self.pos;
        let (mut kind, mut hashes, mut parent, mut medium) = (None, None, None, None);
        for _ in 0..n {
            match self.str()? {
                "type" => kind = Some(self.str()?),
                "block_hashes" => hashes = Some(self.hashes()?),
                "parent_block_hash" => parent = self.opt_hash()?,
                "medium" => medium = self.opt_str()?,
                _ => self.skip(2)?,
            }
        }
        let missing = |field: &str| Error::EventDecode {
            offset: start,
            reason: format!("event map without \"{field}\""),
        };
        let kind = kind.ok_or_else(|| missing("type"))?;
        Ok(match kind {
            "BlockStored" => Event::Stored {
                hashes: hashes.ok_or_else(|| missing("block_hashes"))?,
                parent,
                tier: tier_of_medium(medium),
            },
            "BlockRemoved" => Event::Removed {
                hashes: hashes.ok_or_else(|| missing("block_hashes"))?,
                tier: tier_of_medium(medium),
            },
            "AllBlocksCleared" => Event::Cleared,
            _ => Event::Unknown,
        })
    }

    fn positional_event(&mut self, n: usize) -> Result<Event> {
        if n == 0 {
            return Err(self.err("empty positional event"));
        }
        let kind = self.str()?;
        let need = |c: &Self, k: usize| {
            if n < k {
                Err(c.err(format!("{kind} needs {k} fields, found {n}")))
            } else {
                Ok(())
            }
        };
        let (event, used) = match kind {
            "BlockStored" => {
                need(self, 3)?;
                let hashes = self.hashes()?;
                let parent = self.opt_hash()?;
                // token_ids, block_size and lora_id sit between the parent and the medium.
                let mut used = 3;
                while used < n.min(6) {
                    self.skip(1)?;
                    used += 1;
                }
                let medium = if n > 6 {
                    used += 1;
                    self.opt_str()?
                } else {
                    None
                };
                (
                    Event::Stored {
                        hashes,
                        parent,
                        tier: tier_of_medium(medium),
                    },
                    used,
                )
            }
            "BlockRemoved" => {
                need(self, 2)?;
                let hashes = self.hashes()?;
                let medium = if n > 2 { self.opt_str()? } else { None };
                (
                    Event::Removed {
                        hashes,
                        tier: tier_of_medium(medium),
                    },
                    n.min(3),
                )
            }
            "AllBlocksCleared" => (Event::Cleared, 1),
            _ => (Event::Unknown, 1),
        };
        for _ in used..n {
            self.skip(1)?;
        }
        Ok(event)
    }
}

/// Decodes one msgpack `KVEventBatch`. Nothing is applied here: callers validate the whole batch
/// before changing state.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch> {
    let mut c = Cursor {
        buf: payload,
        pos: 0,
    };
    let Some(n) = c.array_len()? else {
        return Err(c.err("batch must be an array [ts, events, dp_rank]"));
    };
    if n < 2 {
        return Err(c.err(format!("batch has {n} fields, at least 2 expected")));
    }
    let ts = c.number()?;
    let Some(count) = c.array_len()? else {
        return Err(c.err("events array expected"));
    };
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        events.push(c.event()?);
    }
    let dp_rank = if n > 2 {
        if c.is_nil()? {
            None
        } else {
            Some(match c.int()? {
                Int::Signed(v) => v,
                Int::Unsigned(v) => v as i64,
            })
        }
    } else {
        None
    };
    for _ in 3..n {
        c.skip(1)?;
    }
    if c.pos != payload.len() {
        return Err(c.err(format!(
            "{} trailing bytes after the batch",
            payload.len() - c.pos
        )));
    }
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
    })
}
