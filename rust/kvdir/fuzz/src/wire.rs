//! A MessagePack writer for SGLang `KVEventBatch`es, both encodings (tagged maps, SGLang ≥ 0.5.20;
//! positional arrays, ≤ 0.5.16), with a choice of integer widths so that every integer marker of
//! the decoder is reached.

use arbitrary::Arbitrary;

/// How block hashes are written.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum IntStyle {
    /// The shortest form (fixint, int 8/16/32/64, uint 8/16/32/64).
    Compact,
    /// Always `int 64` (0xd3), as SGLang's msgspec writes large hashes.
    Signed64,
    /// Always `uint 64` (0xcf) of the two's-complement bits, as a vLLM-style producer would.
    Unsigned64,
}

/// A MessagePack value (only what event batches use).
#[derive(Debug, Clone)]
pub enum V {
    /// nil
    Nil,
    /// An integer, written in the given style.
    Int(i64, IntStyle),
    /// float 64
    F64(f64),
    /// float 32
    F32(f32),
    /// str
    Str(String),
    /// array
    Arr(Vec<V>),
    /// map with string keys
    Map(Vec<(String, V)>),
}

/// The encoded bytes of `v`.
#[must_use]
pub fn encode(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    write(v, &mut out);
    out
}

fn int(i: i64, style: IntStyle, out: &mut Vec<u8>) {
    match style {
        IntStyle::Signed64 => {
            out.push(0xd3);
            out.extend_from_slice(&i.to_be_bytes());
        }
        IntStyle::Unsigned64 => {
            out.push(0xcf);
            out.extend_from_slice(&(i as u64).to_be_bytes());
        }
        IntStyle::Compact => {
            if (0..128).contains(&i) || (-32..0).contains(&i) {
                out.push(i as i8 as u8);
            } else if let Ok(u) = u8::try_from(i) {
                out.extend_from_slice(&[0xcc, u]);
            } else if let Ok(u) = u16::try_from(i) {
                out.push(0xcd);
                out.extend_from_slice(&u.to_be_bytes());
            } else if let Ok(u) = u32::try_from(i) {
                out.push(0xce);
                out.extend_from_slice(&u.to_be_bytes());
            } else if let Ok(u) = u64::try_from(i) {
                out.push(0xcf);
                out.extend_from_slice(&u.to_be_bytes());
            } else if let Ok(s) = i8::try_from(i) {
                out.extend_from_slice(&[0xd0, s as u8]);
            } else if let Ok(s) = i16::try_from(i) {
                out.push(0xd1);
                out.extend_from_slice(&s.to_be_bytes());
            } else if let Ok(s) = i32::try_from(i) {
                out.push(0xd2);
                out.extend_from_slice(&s.to_be_bytes());
            } else {
                out.push(0xd3);
                out.extend_from_slice(&i.to_be_bytes());
            }
        }
    }
}

fn len(n: usize, fix: u8, fix_max: usize, m16: u8, out: &mut Vec<u8>) {
    if n <= fix_max {
        out.push(fix | n as u8);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(m16);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(m16 + 1);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

fn write(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::Int(i, style) => int(*i, *style, out),
        V::F64(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_be_bytes());
        }
        V::F32(f) => {
            out.push(0xca);
            out.extend_from_slice(&f.to_be_bytes());
        }
        V::Str(s) => {
            if s.len() < 32 {
                out.push(0xa0 | s.len() as u8);
            } else if let Ok(n) = u8::try_from(s.len()) {
                out.extend_from_slice(&[0xd9, n]);
            } else {
                out.push(0xda);
                out.extend_from_slice(&(s.len() as u16).to_be_bytes());
            }
            out.extend_from_slice(s.as_bytes());
        }
        V::Arr(items) => {
            len(items.len(), 0x90, 15, 0xdc, out);
            for i in items {
                write(i, out);
            }
        }
        V::Map(entries) => {
            len(entries.len(), 0x80, 15, 0xde, out);
            for (k, v) in entries {
                write(&V::Str(k.clone()), out);
                write(v, out);
            }
        }
    }
}

/// A string value.
#[must_use]
pub fn s(x: &str) -> V {
    V::Str(x.to_owned())
}

fn hashes(hs: &[i64], style: IntStyle) -> V {
    V::Arr(hs.iter().map(|&h| V::Int(h, style)).collect())
}

fn tokens(n: usize) -> V {
    V::Arr(
        (0..n as i64 * 4)
            .map(|t| V::Int(t * 1000, IntStyle::Compact))
            .collect(),
    )
}

/// `BlockStored` as a tagged map (with the fields SGLang 0.5.23 sends, in its order).
#[must_use]
pub fn stored_map(hs: &[i64], parent: Option<i64>, medium: Option<&str>, style: IntStyle) -> V {
    V::Map(vec![
        ("type".into(), s("BlockStored")),
        ("block_hashes".into(), hashes(hs, style)),
        (
            "parent_block_hash".into(),
            parent.map_or(V::Nil, |p| V::Int(p, style)),
        ),
        ("token_ids".into(), tokens(hs.len())),
        ("block_size".into(), V::Int(4, IntStyle::Compact)),
        ("lora_id".into(), V::Nil),
        ("medium".into(), medium.map_or(V::Nil, s)),
    ])
}

/// `BlockStored` as a positional array; no medium field when `medium` is `None` (SGLang < 0.5.8).
#[must_use]
pub fn stored_positional(
    hs: &[i64],
    parent: Option<i64>,
    medium: Option<&str>,
    style: IntStyle,
) -> V {
    let mut v = vec![
        s("BlockStored"),
        hashes(hs, style),
        parent.map_or(V::Nil, |p| V::Int(p, style)),
        tokens(hs.len()),
        V::Int(4, IntStyle::Compact),
        V::Nil,
    ];
    if let Some(m) = medium {
        v.push(s(m));
    }
    V::Arr(v)
}

/// `BlockRemoved` as a tagged map.
#[must_use]
pub fn removed_map(hs: &[i64], medium: Option<&str>, style: IntStyle) -> V {
    V::Map(vec![
        ("type".into(), s("BlockRemoved")),
        ("block_hashes".into(), hashes(hs, style)),
        ("medium".into(), medium.map_or(V::Nil, s)),
    ])
}

/// `BlockRemoved` as a positional array.
#[must_use]
pub fn removed_positional(hs: &[i64], medium: Option<&str>, style: IntStyle) -> V {
    let mut v = vec![s("BlockRemoved"), hashes(hs, style)];
    if let Some(m) = medium {
        v.push(s(m));
    }
    V::Arr(v)
}

/// An event of a type name the decoder does not know, with one extra field.
#[must_use]
pub fn unknown(positional: bool) -> V {
    if positional {
        V::Arr(vec![
            s("BlockPinned"),
            V::Arr(vec![V::Int(1, IntStyle::Compact)]),
        ])
    } else {
        V::Map(vec![
            ("type".into(), s("BlockPinned")),
            ("extra".into(), V::Map(vec![("k".into(), V::F32(0.5))])),
        ])
    }
}

/// `AllBlocksCleared`.
#[must_use]
pub fn cleared(positional: bool) -> V {
    if positional {
        V::Arr(vec![s("AllBlocksCleared")])
    } else {
        V::Map(vec![("type".into(), s("AllBlocksCleared"))])
    }
}
