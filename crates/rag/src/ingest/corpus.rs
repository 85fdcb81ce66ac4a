//! The bundled corpus: Debian's `git-doc` package (Git's HTML manuals, GPL-2.0), fetched with
//! `apt-get download` and unpacked with `dpkg-deb`, so a fresh Debian machine or container can
//! get it from its package registry without root.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::{read_paths, Document};

/// Corpus names `--corpus` accepts.
pub const CORPORA: &[&str] = &["git-doc", "none"];

const DOC_SUBDIR: &str = "usr/share/doc/git-doc";

/// Directory holding the corpus's HTML pages, fetching the package into `data_dir` if needed.
pub fn git_doc_dir(data_dir: &Path) -> Result<PathBuf> {
    let root = data_dir.join("corpus").join("git-doc");
    let docs = root.join(DOC_SUBDIR);
    if docs.join("git-stash.html").exists() {
        return Ok(docs);
    }
    let installed = Path::new("/").join(DOC_SUBDIR);
    if installed.join("git-stash.html").exists() {
        return Ok(installed);
    }
    std::fs::create_dir_all(&root)?;
    eprintln!("corpus: downloading Debian package git-doc");
    let status = Command::new("apt-get")
        .args(["download", "git-doc"])
        .current_dir(&root)
        .status()
        .context("running `apt-get download git-doc` (is this a Debian-based system?)")?;
    if !status.success() {
        bail!(
            "`apt-get download git-doc` failed; run `apt-get update` first, or pass --corpus none"
        );
    }
    let deb = std::fs::read_dir(&root)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("apt-get download left no .deb")?;
    let status = Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(&root)
        .status()
        .context("running dpkg-deb")?;
    if !status.success() {
        bail!("dpkg-deb -x {} failed", deb.display());
    }
    std::fs::remove_file(&deb)?;
    Ok(docs)
}

/// The corpus as documents: every HTML page, id = its path under the doc directory
/// (`git-stash.html`, `howto/revert-branch-rebase.html`).
pub fn load(name: &str, data_dir: &Path) -> Result<Vec<Document>> {
    match name {
        "none" => Ok(Vec::new()),
        "git-doc" => {
            let dir = git_doc_dir(data_dir)?;
            let mut docs = read_paths(&[dir])?;
            docs.retain(|d| d.id.ends_with(".html"));
            for d in &mut docs {
                d.source = format!("git-doc/{}", d.id);
            }
            Ok(docs)
        }
        other => bail!("corpus {other:?}: expected one of {CORPORA:?}"),
    }
}
