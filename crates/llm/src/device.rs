//! The one place that decides where models run. The default build is CPU-only; the `cuda`
//! feature forwards to candle's CUDA backend.

use anyhow::{bail, Result};
use candle_core::Device;

/// Parses `cpu`, `cuda`, `cuda:N` or `auto` (CUDA device 0 when built with CUDA and present).
/// A CUDA device is also handed to the GPU memory gauges.
pub fn device(spec: &str) -> Result<Device> {
    let device = parse(spec)?;
    telemetry::gpu::memory::watch(&device);
    Ok(device)
}

/// Keeps freed memory in the process instead of handing it back to the kernel. Every candle op
/// allocates its output; with glibc's defaults a prefill's multi-megabyte activations come from
/// fresh `mmap`s, or from a per-thread arena's heap that shrinks and regrows, so each op first
/// faults in and zeroes its pages: about a third more time to the first token of a long prompt
/// (docs/PERFORMANCE.md has the figures). Process-wide, idempotent, glibc only; one arena
/// costs little here, where a few threads allocate large buffers. Call it first thing in
/// `main`, before any thread exists: a thread keeps the arena it already has.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // glibc refuses an mmap threshold above 32 MiB; allocations below it come from the
        // heap, the heap is trimmed only past 1 GiB of free space at its top, and every
        // thread uses the one main heap.
        const MMAP_THRESHOLD: libc::c_int = 32 << 20;
        const TRIM_THRESHOLD: libc::c_int = 1 << 30;
        // SAFETY: mallopt only changes allocator parameters; it is thread-safe.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
        }
    }
}

fn parse(spec: &str) -> Result<Device> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        "auto" if candle_core::utils::cuda_is_available() => Ok(Device::new_cuda(0)?),
        "auto" => Ok(Device::Cpu),
        _ => {
            let Some(rest) = spec.strip_prefix("cuda") else {
                bail!("device {spec:?}: expected cpu, cuda, cuda:N or auto");
            };
            let ordinal = match rest.strip_prefix(':') {
                Some(n) => n.parse::<usize>().map_err(|_| {
                    anyhow::anyhow!("device {spec:?}: N in cuda:N must be a number")
                })?,
                None if rest.is_empty() => 0,
                None => bail!("device {spec:?}: expected cpu, cuda, cuda:N or auto"),
            };
            if !candle_core::utils::cuda_is_available() {
                bail!(
                    "device {spec:?}: this build has no CUDA support (rebuild with `--features cuda` on a machine with the CUDA toolkit)"
                );
            }
            Ok(Device::new_cuda(ordinal)?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_and_auto_work_without_a_gpu() {
        assert!(device("cpu").unwrap().is_cpu());
        assert!(device("auto").is_ok());
    }

    #[test]
    fn bad_specs_say_what_is_expected() {
        let err = device("tpu").unwrap_err().to_string();
        assert!(err.contains("expected cpu, cuda"), "{err}");
        assert!(device("cuda:x").is_err());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_clear_error() {
        let err = device("cuda:0").unwrap_err().to_string();
        assert!(err.contains("no CUDA support"), "{err}");
    }
}
