//! Small text checkpoint files, replaced atomically.
//!
//! Format (UTF-8, one item per line, like Kafka's checkpoint files):
//!
//! ```text
//! 0                 format version
//! <n>               number of entries
//! <entry>           n lines, space-separated fields
//! ```
//!
//! Writes go to `<name>.tmp`, are fsynced, renamed over the file, and the directory is
//! fsynced, so a crash leaves either the old or the new file, never a mix.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;

const VERSION: &str = "0";

/// Writes `lines` as a checkpoint file at `path`, atomically and durably.
pub fn write(path: &Path, lines: &[String]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut text = String::with_capacity(16 + lines.len() * 24);
    text.push_str(VERSION);
    text.push('\n');
    text.push_str(&lines.len().to_string());
    text.push('\n');
    for line in lines {
        text.push_str(line);
        text.push('\n');
    }
    {
        let mut file = File::create(&tmp)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Reads a checkpoint file: `Ok(None)` when it does not exist, an `InvalidData` error when
/// it is not a well-formed checkpoint.
pub fn read(path: &Path) -> io::Result<Option<Vec<String>>> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let bad = |why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {why}", path.display()),
        )
    };
    let mut lines = text.lines();
    if lines.next() != Some(VERSION) {
        return Err(bad("unknown version"));
    }
    let count: usize = lines
        .next()
        .and_then(|l| l.trim().parse().ok())
        .ok_or_else(|| bad("bad entry count"))?;
    let entries: Vec<String> = lines.map(str::to_owned).collect();
    if entries.len() != count {
        return Err(bad("entry count does not match"));
    }
    Ok(Some(entries))
}

/// fsyncs a directory so renames and new files in it survive a crash.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_detects_damage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cp");
        assert_eq!(read(&path).unwrap(), None);
        write(&path, &["1 2".into(), "3 4".into()]).unwrap();
        assert_eq!(read(&path).unwrap().unwrap(), vec!["1 2", "3 4"]);
        fs::write(&path, "0\n3\n1 2\n").unwrap();
        assert_eq!(read(&path).unwrap_err().kind(), io::ErrorKind::InvalidData);
        fs::write(&path, "7\n0\n").unwrap();
        assert!(read(&path).is_err());
    }
}
