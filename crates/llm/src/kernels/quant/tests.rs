//! The quantised kernels against the dense product, on every instruction set the CPU level allows.
use super::*;

/// A deterministic pseudo-random sequence in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn q4_matrix(rows: usize, cols: usize) -> QMatrix {
    let dense = values(rows * cols, 3);
    let t = candle_core::Tensor::from_vec(dense, (rows, cols), &candle_core::Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::Q4_1).unwrap();
    QMatrix::from_qtensors(&[&q]).unwrap()
}

fn dense_rows(w: &QMatrix) -> Vec<Vec<f32>> {
    (0..w.rows())
        .map(|r| {
            let mut row = vec![0f32; w.cols()];
            w.dequantize_row(r, &mut row);
            row
        })
        .collect()
}

fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::detect() != Isa::Portable {
            v.push(Isa::Avx2);
        }
        if Isa::detect() == Isa::Avx512Vnni {
            v.push(Isa::Avx512Vnni);
        }
    }
    v
}

/// Each kernel computes the f32 product of the dequantised weights and the dequantised
/// activations (to float rounding) for every batch size up to past one tile; and the
/// activations' 8-bit rounding stays small against the unquantised product.
#[test]
fn kernels_match_the_dense_product() {
    let (rows, cols) = (37, 576);
    for w in [
        q4_matrix(rows, cols),
        QMatrix::quantize_q8(&values(rows * cols, 5), rows, cols),
    ] {
        let dense = dense_rows(&w);
        for n_seq in [1, 2, 3, 4, 5, 9] {
            let x = values(n_seq * cols, 11 + n_seq as u64);
            let mut acts = QActs::default();
            acts.quantize(&x, n_seq, cols);
            for isa in isas() {
                let mut out = vec![0f32; n_seq * rows];
                matmul_with(isa, &w, &acts, &mut out);
                for s in 0..n_seq {
                    let a = acts.row(s);
                    let xq: Vec<f32> = (0..cols).map(|c| a.q[c] as f32 * a.d[c / BLOCK]).collect();
                    for r in 0..rows {
                        let dot =
                            |x: &[f32]| -> f32 { dense[r].iter().zip(x).map(|(a, b)| a * b).sum() };
                        let (exact, unquantised) = (dot(&xq), dot(&x[s * cols..][..cols]));
                        let got = out[s * rows + r];
                        let what = format!("{:?} {isa:?} seq {s} row {r}", w.format());
                        assert!(
                            (got - exact).abs() < 1e-4 * (1.0 + exact.abs()),
                            "{what}: {got} vs {exact}"
                        );
                        assert!((got - unquantised).abs() < 0.2, "{what}");
                    }
                }
            }
        }
    }
}

/// The SIMD kernels do the same integer arithmetic as the portable one: results agree to
/// float rounding.
#[test]
fn simd_kernels_agree_with_the_portable_one() {
    let (rows, cols) = (300, 1536);
    let w = q4_matrix(rows, cols);
    let mut acts = QActs::default();
    acts.quantize(&values(3 * cols, 9), 3, cols);
    let mut reference = vec![0f32; 3 * rows];
    matmul_with(Isa::Portable, &w, &acts, &mut reference);
    for isa in isas() {
        let mut out = vec![0f32; 3 * rows];
        matmul_with(isa, &w, &acts, &mut out);
        for (a, b) in out.iter().zip(&reference) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "{isa:?}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn q4_blocks_are_the_ggml_bytes() {
    let w = q4_matrix(4, 64);
    let t = candle_core::Tensor::from_vec(values(4 * 64, 3), (4, 64), &candle_core::Device::Cpu)
        .unwrap();
    let q = QTensor::quantize(&t, GgmlDType::Q4_1).unwrap();
    let reference = q
        .dequantize(&candle_core::Device::Cpu)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(dense_rows(&w), reference);
    assert_eq!(w.size_in_bytes(), q.storage_size_in_bytes());
}

#[test]
fn quantizing_zeros_gives_zeros() {
    let mut acts = QActs::default();
    acts.quantize(&[0.0; 64], 1, 64);
    let w = QMatrix::quantize_q8(&values(64, 1), 1, 64);
    let mut out = [1f32];
    matmul(&w, &acts, &mut out);
    assert_eq!(out, [0.0]);
}
