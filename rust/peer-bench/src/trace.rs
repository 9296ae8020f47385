//! Reading a Mooncake trace (`{"timestamp", "input_length", "output_length", "hash_ids"}` per
//! line), plain or xz-compressed as the project bundles it (`data/traces/mooncake/`).

use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};

/// One request of the trace: its prompt's 512-token blocks, ids global across the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRequest {
    /// Block ids, root first; equal ids at equal positions are the same prefix.
    pub hash_ids: Vec<u64>,
}

/// Reads the trace at `path`; a `.xz` file is decompressed with the system's `xz`.
///
/// # Errors
/// The file cannot be read (or `xz` run), or a line has no valid `hash_ids` array.
pub fn read_trace(path: &Path) -> io::Result<Vec<TraceRequest>> {
    let compressed = path.extension().is_some_and(|e| e == "xz");
    let mut child = None;
    let reader: Box<dyn Read> = if compressed {
        let mut c = Command::new("xz")
            .arg("-dc")
            .arg(path)
            .stdout(Stdio::piped())
            .spawn()?;
        let out = c.stdout.take().expect("piped");
        child = Some(c);
        Box::new(out)
    } else {
        Box::new(std::fs::File::open(path)?)
    };
    let mut out = Vec::new();
    for (n, line) in BufReader::new(reader).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let hash_ids = parse_hash_ids(&line).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}:{}: no \"hash_ids\" array of ints",
                    path.display(),
                    n + 1
                ),
            )
        })?;
        out.push(TraceRequest { hash_ids });
    }
    if let Some(mut c) = child {
        let status = c.wait()?;
        if !status.success() {
            return Err(io::Error::other(format!(
                "xz -dc {}: {status}",
                path.display()
            )));
        }
    }
    Ok(out)
}

/// The `"hash_ids": [..]` array of one JSON line (the trace's only nested value).
fn parse_hash_ids(line: &str) -> Option<Vec<u64>> {
    let start = line.find("\"hash_ids\"")?;
    let rest = &line[start + "\"hash_ids\"".len()..];
    let open = rest.find('[')?;
    let close = rest[open..].find(']')? + open;
    let body = rest[open + 1..close].trim();
    if body.is_empty() {
        return Some(Vec::new());
    }
    body.split(',').map(|x| x.trim().parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::parse_hash_ids;

    #[test]
    fn hash_ids_are_read_and_bad_ones_refused() {
        let ok =
            r#"{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [0, 14, 15]}"#;
        assert_eq!(parse_hash_ids(ok), Some(vec![0, 14, 15]));
        assert_eq!(parse_hash_ids(r#"{"hash_ids": []}"#), Some(vec![]));
        assert_eq!(parse_hash_ids(r#"{"hash_ids": [1, -2]}"#), None);
        assert_eq!(parse_hash_ids(r#"{"ids": [1]}"#), None);
    }
}
