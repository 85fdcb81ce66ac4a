//! Start-up checks of an embedded shard's files, so that a truncated or corrupted store fails
//! with an error naming the file instead of a panic deep in the engine (or, worse, a server
//! that starts and panics on the first search). The engine checks some files itself and names
//! them (`edge_config.json`, `segment.json`, `version.info`); these are the ones it reads
//! without checking (sizes and headers) or reads only when a request comes.

use std::fs;
use std::path::{Path, PathBuf};

use super::StoreError;

/// Checks every file of the shard at `shard` that has a shape we can see from outside.
pub fn check_shard_files(shard: &Path) -> Result<(), StoreError> {
    let mut files = Vec::new();
    walk(shard, &mut files)?;
    for file in &files {
        check_file(file).map_err(|why| {
            StoreError::Backend(format!(
                "damaged store file {}: {why}; restore the data directory from a backup, or \
                 move it away to start empty",
                file.display()
            ))
        })?;
    }
    Ok(())
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), StoreError> {
    let entries = fs::read_dir(dir)
        .map_err(|e| StoreError::Backend(format!("reading {}: {e}", dir.display())))?;
    for entry in entries {
        let path = entry
            .map_err(|e| StoreError::Backend(format!("reading {}: {e}", dir.display())))?
            .path();
        if path.is_dir() {
            walk(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

fn check_file(file: &Path) -> Result<(), String> {
    let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let parent = file.parent().unwrap_or(Path::new(""));
    let size = fs::metadata(file).map_err(|e| e.to_string())?.len();
    let in_wal = parent.file_name().is_some_and(|d| d == "wal");
    if name.ends_with(".json") {
        let text = fs::read(file).map_err(|e| e.to_string())?;
        serde_json::from_slice::<serde_json::Value>(&text)
            .map_err(|e| format!("not valid JSON ({e})"))?;
    } else if in_wal && (name.starts_with("open-") || name.starts_with("closed-")) {
        // A WAL segment opens with the magic `wal` and a version byte; the engine refuses a
        // bad header but names only the directory.
        let mut header = [0u8; 8];
        let read = fs::File::open(file)
            .and_then(|mut f| std::io::Read::read(&mut f, &mut header))
            .map_err(|e| e.to_string())?;
        if read < header.len() || &header[..3] != b"wal" {
            return Err(format!(
                "not a write-ahead-log segment ({size} bytes, header {:02x?})",
                &header[..read]
            ));
        }
    } else if name == "status.dat" {
        // Fixed-size structs of 8-byte fields; the engine indexes into them unchecked.
        if size == 0 || size % 8 != 0 {
            return Err(format!("{size} bytes, expected a non-zero multiple of 8"));
        }
    } else if let Some(expected) = fixed_size(parent, name)? {
        if size != expected {
            return Err(format!(
                "{size} bytes, expected {expected} (its config.json says so)"
            ));
        }
    }
    Ok(())
}

/// The size a memory-mapped chunk or page must have, from its directory's `config.json`:
/// vector chunks (`chunk_N.mmap`, `chunk_size_bytes`) and payload pages (`page_N.dat`,
/// `page_size_bytes`). The engine maps them whole and reads past a truncated end at search time.
fn fixed_size(dir: &Path, name: &str) -> Result<Option<u64>, String> {
    let key = if name.starts_with("chunk_") && name.ends_with(".mmap") {
        "chunk_size_bytes"
    } else if name.starts_with("page_") && name.ends_with(".dat") {
        "page_size_bytes"
    } else {
        return Ok(None);
    };
    let Ok(text) = fs::read(dir.join("config.json")) else {
        return Ok(None);
    };
    let config: serde_json::Value = serde_json::from_slice(&text).unwrap_or_default();
    Ok(config[key].as_u64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn damaged_files_are_named_and_sound_ones_pass() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("wal")).unwrap();
        fs::create_dir_all(root.join("seg/vectors")).unwrap();
        fs::write(root.join("edge_config.json"), b"{}").unwrap();
        fs::write(root.join("wal/open-1"), b"wal\0\x01\x02\x03\x04rest").unwrap();
        fs::write(root.join("seg/vectors/status.dat"), [0u8; 16]).unwrap();
        fs::write(
            root.join("seg/vectors/config.json"),
            br#"{"chunk_size_bytes": 32}"#,
        )
        .unwrap();
        fs::write(root.join("seg/vectors/chunk_0.mmap"), [0u8; 32]).unwrap();
        check_shard_files(root).unwrap();
        for (file, bytes, says) in [
            ("edge_config.json", &b""[..], "not valid JSON"),
            ("wal/open-1", b"garbage!", "not a write-ahead-log segment"),
            ("seg/vectors/status.dat", b"abc", "3 bytes"),
            (
                "seg/vectors/chunk_0.mmap",
                &[0u8; 10][..],
                "10 bytes, expected 32",
            ),
        ] {
            let before = fs::read(root.join(file)).unwrap();
            fs::write(root.join(file), bytes).unwrap();
            let e = check_shard_files(root).unwrap_err().to_string();
            assert!(e.contains(&root.join(file).display().to_string()), "{e}");
            assert!(e.contains(says), "{e}");
            fs::write(root.join(file), before).unwrap();
        }
    }
}
