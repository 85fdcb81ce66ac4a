//! A damaged data directory at start-up: the real binary, started on a store whose files were
//! truncated or overwritten, exits non-zero with an error naming the damaged file, and never
//! panics. One store is written through `EdgeStore`, then copied once per kind of damage; the
//! servers start side by side.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rag::retrieve::edge::EdgeStore;
use rag::retrieve::{Chunk, VectorStore};
use telemetry::span::Stage;

use crate::helpers::models_dir;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// The first file under `dir` whose path ends with `suffix`.
fn find(dir: &Path, suffix: &str) -> PathBuf {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.to_string_lossy().ends_with(suffix) {
                return path;
            }
        }
    }
    panic!("no {suffix} under {}", dir.display())
}

/// A store of a few chunks, as the server would have left it (384-d, MiniLM's dimension).
fn sound_store(data: &Path) {
    let store = EdgeStore::open(data, "ragscope", 384).unwrap();
    let chunks: Vec<Chunk> = (0..3)
        .map(|i| Chunk {
            id: uuid::Uuid::new_v4().to_string(),
            doc_id: format!("doc{i}"),
            text: format!("chunk number {i}"),
            source: "test".into(),
            position: 0,
            metadata: Default::default(),
        })
        .collect();
    let vectors: Vec<Vec<f32>> = (0..3)
        .map(|i| (0..384).map(|j| ((i * 384 + j) as f32).sin()).collect())
        .collect();
    store
        .upsert(&chunks, &vectors, &Stage::root("damaged-store-test"))
        .unwrap();
}

#[test]
fn a_damaged_store_stops_the_server_with_an_error_naming_the_file() {
    let sound = tempfile::tempdir().unwrap();
    sound_store(sound.path());
    type Damage = fn(&Path) -> PathBuf;
    let kinds: &[(&str, Damage)] = &[
        ("shard config emptied", |d| {
            let f = find(d, "edge_config.json");
            std::fs::write(&f, b"").unwrap();
            f
        }),
        ("segment state overwritten", |d| {
            let f = find(d, "segment.json");
            std::fs::write(&f, b"garbage").unwrap();
            f
        }),
        ("segment version emptied", |d| {
            let f = find(d, "version.info");
            std::fs::write(&f, b"").unwrap();
            f
        }),
        ("WAL header overwritten", |d| {
            let f = find(d, "wal/open-1");
            let mut bytes = std::fs::read(&f).unwrap();
            bytes[..16].copy_from_slice(b"not a wal header");
            std::fs::write(&f, bytes).unwrap();
            f
        }),
        ("vector status truncated", |d| {
            let f = find(d, "vectors/status.dat");
            std::fs::File::options()
                .write(true)
                .open(&f)
                .unwrap()
                .set_len(3)
                .unwrap();
            f
        }),
        ("vector chunk truncated", |d| {
            let f = find(d, "chunk_0.mmap");
            std::fs::File::options()
                .write(true)
                .open(&f)
                .unwrap()
                .set_len(1000)
                .unwrap();
            f
        }),
        ("payload page truncated", |d| {
            let f = find(d, "payload_storage/page_0.dat");
            std::fs::File::options()
                .write(true)
                .open(&f)
                .unwrap()
                .set_len(0)
                .unwrap();
            f
        }),
    ];
    let started = Instant::now();
    let mut runs = Vec::new();
    for (what, damage) in kinds {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(sound.path(), dir.path());
        let file = damage(dir.path());
        let out = dir.path().join("server.log");
        let child = Command::new(env!("CARGO_BIN_EXE_ragscope"))
            .args(["serve", "--corpus", "none", "--fetch-models", "false"])
            .args(["--listen", "127.0.0.1:0", "--grpc-listen", "off"])
            .arg("--models-dir")
            .arg(models_dir())
            .arg("--data-dir")
            .arg(dir.path())
            .env("OTEL_SDK_DISABLED", "true")
            .env_remove("RAGSCOPE_API_KEYS")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(dir.path().join("server.err")).unwrap())
            .spawn()
            .unwrap();
        runs.push((*what, file, child, dir));
    }
    for (what, file, mut child, dir) in runs {
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if started.elapsed() > Duration::from_secs(120) {
                child.kill().unwrap();
                panic!("{what}: the server did not stop within 120 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap()
            + &std::fs::read_to_string(dir.path().join("server.err")).unwrap();
        assert!(!status.success(), "{what}: exited {status}\n{log}");
        assert!(!log.contains("panicked"), "{what}: a panic\n{log}");
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        let named = log
            .lines()
            .any(|l| l.contains("start-up failed") && l.contains(&*file.to_string_lossy()));
        assert!(named, "{what}: no start-up error naming {name}\n{log}");
    }
}
