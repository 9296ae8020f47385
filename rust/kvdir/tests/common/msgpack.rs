//! A minimal MessagePack writer: just what SGLang's `KVEventBatch` uses, written independently
//! of the decoder under test.

#![allow(dead_code)]

pub enum V {
    Nil,
    Int(i64),
    UInt(u64),
    F64(f64),
    Str(String),
    Arr(Vec<V>),
    Map(Vec<(String, V)>),
}

pub fn encode(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    write(v, &mut out);
    out
}

fn write(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::Int(i) if *i >= 0 => write(&V::UInt(*i as u64), out),
        V::Int(i) if *i >= -32 => out.push(*i as i8 as u8),
        V::Int(i) => {
            out.push(0xd3);
            out.extend_from_slice(&i.to_be_bytes());
        }
        V::UInt(u) if *u < 128 => out.push(*u as u8),
        V::UInt(u) if u32::try_from(*u).is_ok() => {
            out.push(0xce);
            out.extend_from_slice(&(*u as u32).to_be_bytes());
        }
        V::UInt(u) => {
            out.push(0xcf);
            out.extend_from_slice(&u.to_be_bytes());
        }
        V::F64(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_be_bytes());
        }
        V::Str(s) => {
            assert!(s.len() < 256);
            if s.len() < 32 {
                out.push(0xa0 | s.len() as u8);
            } else {
                out.extend_from_slice(&[0xd9, s.len() as u8]);
            }
            out.extend_from_slice(s.as_bytes());
        }
        V::Arr(items) => {
            assert!(items.len() < 65536);
            if items.len() < 16 {
                out.push(0x90 | items.len() as u8);
            } else {
                out.push(0xdc);
                out.extend_from_slice(&(items.len() as u16).to_be_bytes());
            }
            for i in items {
                write(i, out);
            }
        }
        V::Map(entries) => {
            assert!(entries.len() < 16);
            out.push(0x80 | entries.len() as u8);
            for (k, v) in entries {
                write(&V::Str(k.clone()), out);
                write(v, out);
            }
        }
    }
}

pub fn s(x: &str) -> V {
    V::Str(x.to_string())
}

pub fn hashes(hs: &[i64]) -> V {
    V::Arr(hs.iter().map(|&h| V::Int(h)).collect())
}

/// A `BlockStored` event as SGLang ≥ 0.5.20 sends it (a tagged map).
pub fn stored_map(hs: &[i64], parent: Option<i64>, medium: Option<&str>) -> V {
    V::Map(vec![
        ("type".into(), s("BlockStored")),
        ("block_hashes".into(), hashes(hs)),
        ("parent_block_hash".into(), parent.map_or(V::Nil, V::Int)),
        (
            "token_ids".into(),
            V::Arr((0..hs.len() as i64 * 4).map(V::Int).collect()),
        ),
        ("block_size".into(), V::Int(4)),
        ("lora_id".into(), V::Nil),
        ("medium".into(), medium.map_or(V::Nil, s)),
    ])
}

/// The same event as SGLang ≤ 0.5.16 sends it (a positional array; no medium before 0.5.8).
pub fn stored_positional(hs: &[i64], parent: Option<i64>, medium: Option<&str>) -> V {
    let mut v = vec![
        s("BlockStored"),
        hashes(hs),
        parent.map_or(V::Nil, V::Int),
        V::Arr((0..hs.len() as i64 * 4).map(V::Int).collect()),
        V::Int(4),
        V::Nil,
    ];
    if let Some(m) = medium {
        v.push(s(m));
    }
    V::Arr(v)
}

pub fn removed_map(hs: &[i64], medium: Option<&str>) -> V {
    V::Map(vec![
        ("type".into(), s("BlockRemoved")),
        ("block_hashes".into(), hashes(hs)),
        ("medium".into(), medium.map_or(V::Nil, s)),
    ])
}

pub fn removed_positional(hs: &[i64], medium: Option<&str>) -> V {
    let mut v = vec![s("BlockRemoved"), hashes(hs)];
    if let Some(m) = medium {
        v.push(s(m));
    }
    V::Arr(v)
}

pub fn cleared_map() -> V {
    V::Map(vec![("type".into(), s("AllBlocksCleared"))])
}

pub fn batch(events: Vec<V>) -> Vec<u8> {
    encode(&V::Arr(vec![V::F64(1.5), V::Arr(events), V::Int(0)]))
}
