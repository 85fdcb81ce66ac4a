//! One sequence's keys and values on the host, which the CPU decoder
//! ([`super::cpu_decode`]) steps through and the CPU prefill ([`super::cpu_prefill`]) writes:
//! per layer `(n_kv_head, capacity, head_dim)`, head-major like the candle cache. Stored in F16
//! by default (as llama.cpp's cache is): a decode step reads the whole cache of every layer, so
//! half the bytes is a shorter step once the context is long. F32 keeps the exact values (the
//! reference tests, `--kv-cache-dtype f32`). Rows go in and come out as F32; attention loads F16
//! rows straight into F32 registers ([`KvElem`]).

use half::f16;
use half::slice::HalfFloatSliceExt;

/// How the host KV cache stores keys and values (`--kv-cache-dtype`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// IEEE half precision, rounded to nearest: half the bytes of F32 per position.
    #[default]
    F16,
    /// The values exactly as computed.
    F32,
}

impl KvDtype {
    /// Bytes per stored value.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    /// The name `--kv-cache-dtype` takes (and snapshots record).
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }

    /// The dtype [`KvDtype::name`] gives.
    pub fn named(name: &str) -> Option<KvDtype> {
        [KvDtype::F16, KvDtype::F32]
            .into_iter()
            .find(|d| d.name() == name)
    }
}

/// The keys and values of every layer, in one element type.
struct Rows<T> {
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
}

impl<T: Copy> Rows<T> {
    fn new(n_layer: usize, per_layer: usize, zero: T) -> Rows<T> {
        Rows {
            k: (0..n_layer).map(|_| vec![zero; per_layer]).collect(),
            v: (0..n_layer).map(|_| vec![zero; per_layer]).collect(),
        }
    }
}

enum Store {
    F32(Rows<f32>),
    F16(Rows<f16>),
}

/// One sequence's keys and values on the host (the default holds none: what a cache moved
/// out of its request leaves behind).
pub(crate) struct HostKv {
    store: Store,
    pub capacity: usize,
}

/// One layer's keys and values, as stored.
#[derive(Clone, Copy)]
pub(crate) enum KvLayer<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [f16], &'a [f16]),
}

impl Default for HostKv {
    fn default() -> HostKv {
        HostKv {
            store: Store::F32(Rows {
                k: Vec::new(),
                v: Vec::new(),
            }),
            capacity: 0,
        }
    }
}

impl HostKv {
    pub fn new(
        n_layer: usize,
        n_kv_head: usize,
        head_dim: usize,
        capacity: usize,
        dtype: KvDtype,
    ) -> HostKv {
        let per_layer = n_kv_head * capacity * head_dim;
        let store = match dtype {
            KvDtype::F32 => Store::F32(Rows::new(n_layer, per_layer, 0.0)),
            KvDtype::F16 => Store::F16(Rows::new(n_layer, per_layer, f16::ZERO)),
        };
        HostKv { store, capacity }
    }

    pub fn n_layers(&self) -> usize {
        match &self.store {
            Store::F32(r) => r.k.len(),
            Store::F16(r) => r.k.len(),
        }
    }

    /// Layer `li`'s keys and values.
    pub fn layer(&self, li: usize) -> KvLayer<'_> {
        match &self.store {
            Store::F32(r) => KvLayer::F32(&r.k[li], &r.v[li]),
            Store::F16(r) => KvLayer::F16(&r.k[li], &r.v[li]),
        }
    }

    /// Writes `keys` and `values` into layer `li` from element `at` on.
    pub fn write(&mut self, li: usize, at: usize, keys: &[f32], values: &[f32]) {
        let n = keys.len();
        match &mut self.store {
            Store::F32(r) => {
                r.k[li][at..at + n].copy_from_slice(keys);
                r.v[li][at..at + n].copy_from_slice(values);
            }
            Store::F16(r) => {
                r.k[li][at..at + n].convert_from_f32_slice(keys);
                r.v[li][at..at + n].convert_from_f32_slice(values);
            }
        }
    }

    /// Appends layer `li`'s keys and values at elements `range` to `keys` and `values`, as F32.
    pub fn read(
        &self,
        li: usize,
        range: std::ops::Range<usize>,
        keys: &mut Vec<f32>,
        values: &mut Vec<f32>,
    ) {
        match self.layer(li) {
            KvLayer::F32(k, v) => {
                keys.extend_from_slice(&k[range.clone()]);
                values.extend_from_slice(&v[range]);
            }
            KvLayer::F16(k, v) => {
                for (out, src) in [(keys, &k[range.clone()]), (values, &v[range])] {
                    let at = out.len();
                    out.resize(at + src.len(), 0.0);
                    src.convert_to_f32_slice(&mut out[at..]);
                }
            }
        }
    }
}

/// An element type attention reads key and value rows of.
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
    /// `src` as F32: itself, or converted into the front of `buf`.
    fn as_f32<'b>(src: &'b [Self], buf: &'b mut [f32]) -> &'b [f32];

    /// Sixteen elements from `p`, as F32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, and `p` is readable for sixteen elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;

    /// Eight elements from `p`, as F32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C, and `p` is readable for eight elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElem for f32 {
    #[inline(always)]
    fn as_f32<'b>(src: &'b [f32], _: &'b mut [f32]) -> &'b [f32] {
        src
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn as_f32<'b>(src: &'b [f16], buf: &'b mut [f32]) -> &'b [f32] {
        let out = &mut buf[..src.len()];
        src.convert_to_f32_slice(out);
        out
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; `f16` is a transparent `u16`, so sixteen of them are
        // the 256 bits `vcvtph2ps` widens.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<__m256i>())) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; eight `f16` are the 128 bits `vcvtph2ps` widens.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_come_back_as_written_exactly_in_f32_and_rounded_in_f16() {
        let xs: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.0137 + 1e-4).collect();
        let ys: Vec<f32> = xs.iter().map(|x| -3.0 * x).collect();
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let mut kv = HostKv::new(2, 3, 64, 8, dtype);
            kv.write(1, 5 * 64, &xs, &ys);
            let (mut k, mut v) = (Vec::new(), Vec::new());
            kv.read(1, 5 * 64..6 * 64, &mut k, &mut v);
            for (got, want) in k.iter().zip(&xs).chain(v.iter().zip(&ys)) {
                let tol = match dtype {
                    KvDtype::F32 => 0.0,
                    // Half precision keeps 11 significant bits.
                    KvDtype::F16 => want.abs() / 2048.0,
                };
                assert!((got - want).abs() <= tol, "{dtype:?}: {got} for {want}");
            }
            // Other layers and positions are untouched.
            let (mut k0, mut v0) = (Vec::new(), Vec::new());
            kv.read(0, 5 * 64..6 * 64, &mut k0, &mut v0);
            assert!(k0.iter().chain(&v0).all(|&x| x == 0.0));
            let stored = match kv.layer(0) {
                KvLayer::F32(..) => KvDtype::F32,
                KvLayer::F16(..) => KvDtype::F16,
            };
            assert_eq!(stored, dtype);
            assert_eq!(kv.n_layers(), 2);
        }
    }

    #[test]
    fn f16_rows_load_as_they_convert() {
        let xs: Vec<f16> = (0..32)
            .map(|i| f16::from_f32(i as f32 * 0.37 - 5.0))
            .collect();
        let mut buf = [0f32; 32];
        let converted = f16::as_f32(&xs, &mut buf).to_vec();
        assert_eq!(converted[3], xs[3].to_f32());
        for name in ["f16", "f32"] {
            assert_eq!(KvDtype::named(name).unwrap().name(), name);
        }
        assert_eq!(KvDtype::named("bf16"), None);
    }

    /// The AVX-512 loads alone (the test command runs them only where the CPU has them).
    #[cfg(target_arch = "x86_64")]
    mod needs_avx512 {
        use super::*;
        use crate::cpu::Level;

        #[test]
        fn sixteen_f16_load_as_they_convert() {
            crate::cpu::require(Level::Avx512);
            let xs: Vec<f16> = (0..16)
                .map(|i| f16::from_f32(i as f32 * 0.37 - 5.0))
                .collect();
            let mut buf = [0f32; 16];
            let converted = f16::as_f32(&xs, &mut buf).to_vec();
            let mut lanes = [0f32; 16];
            // SAFETY: the CPU runs AVX-512 (required above); 16 elements of 16 are readable.
            unsafe {
                std::arch::x86_64::_mm512_storeu_ps(lanes.as_mut_ptr(), f16::load16(xs.as_ptr()))
            };
            assert_eq!(lanes, converted[..]);
        }
    }
}
