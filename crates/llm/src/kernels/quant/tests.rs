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
    let all = [
        Isa::Portable,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni,
    ];
    all.into_iter().filter(|isa| isa.runs_here()).collect()
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

/// The panel kernel on Q4_1 against the portable blocks-as-shipped kernel (the same integer
/// arithmetic, summed in another order): a partial last group of columns, both inner sizes of
/// the model, row counts around the register tile and past a work item, with and without the
/// residual; from f32 rows (prefill) and from quantised ones (decode), the same bits.
#[cfg(target_arch = "x86_64")]
#[test]
fn panel_kernel_matches_the_portable_kernel() {
    if !crate::kernels::avx2() {
        eprintln!("no AVX2 here: the panel kernel does not run");
        return;
    }
    for (n, k) in [(37, 576), (64, 1536), (300, 576)] {
        let w = q4_matrix(n, k);
        let panels = panels::Panels::pack(&w);
        for m in [1, 2, 3, 4, 5, 67] {
            let x = values(m * k, 7 + m as u64);
            let mut acts = QActs::default();
            acts.quantize(&x, m, k);
            let mut reference = vec![0f32; m * n];
            matmul_with(Isa::Portable, &w, &acts, &mut reference);
            let residual = values(m * n, 13);
            let mut out = vec![0f32; m * n];
            let mut added = vec![0f32; m * n];
            panels.forward_rows(&x, m, &mut out, None);
            panels.forward_rows(&x, m, &mut added, Some(&residual));
            let mut decoded = vec![0f32; m * n];
            panels.matmul(&acts, &mut decoded, None);
            assert_eq!(decoded, out, "({n}, {k}) × {m} rows: quantised first");
            for (i, &want) in reference.iter().enumerate() {
                let what = format!("({n}, {k}) × {m} rows, output {i}");
                assert!(
                    (out[i] - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "{what}: {} vs {want}",
                    out[i]
                );
                assert_eq!(added[i], out[i] + residual[i], "{what}: residual");
            }
        }
    }
}

/// A row's outputs do not depend on the rows beside it: the same rows in one call of 131, in
/// calls of 32, of 3 and one by one are bit-identical (what chunked prefill relies on, and a
/// decode step verifying drafts or batching sequences), for each format the panels run here.
#[cfg(target_arch = "x86_64")]
#[test]
fn panel_kernel_rows_are_the_same_in_any_chunking() {
    let (n, k, m) = (96, 576, 131);
    let formats = [
        q4_matrix(n, k),
        QMatrix::quantize_q8(&values(n * k, 3), n, k),
    ];
    for w in formats {
        if !panels::Panels::runs(w.format(), Isa::detect()) {
            eprintln!("{:?} panels do not run on this CPU", w.format());
            continue;
        }
        let panels = panels::Panels::pack(&w);
        let x = values(m * k, 21);
        let mut whole = vec![0f32; m * n];
        panels.forward_rows(&x, m, &mut whole, None);
        for chunk in [32, 3, 1] {
            let mut parts = vec![0f32; m * n];
            for (xs, out) in x.chunks(chunk * k).zip(parts.chunks_mut(chunk * n)) {
                panels.forward_rows(xs, xs.len() / k, out, None);
            }
            assert_eq!(parts, whole, "{:?}, chunks of {chunk}", w.format());
        }
    }
}

/// The 16-bit block sums at their largest: weights all at nibble 15 and activations all at
/// ±127 give 8 · 2 · 15 · 127 per lane, still exact.
#[cfg(target_arch = "x86_64")]
#[test]
fn panel_kernel_block_sums_do_not_overflow() {
    if !crate::kernels::avx2() {
        return;
    }
    let (n, k) = (8, 64);
    // Each block: one 0 and 31 ones, so q = 15 for all but one weight.
    let dense: Vec<f32> = (0..n * k)
        .map(|i| if i % 32 == 5 { 0.0 } else { 1.0 })
        .collect();
    let t = candle_core::Tensor::from_vec(dense, (n, k), &candle_core::Device::Cpu).unwrap();
    let w = QMatrix::from_qtensors(&[&QTensor::quantize(&t, GgmlDType::Q4_1).unwrap()]).unwrap();
    let panels = panels::Panels::pack(&w);
    for sign in [1.0f32, -1.0] {
        let x = vec![sign; 2 * k];
        let mut acts = QActs::default();
        acts.quantize(&x, 2, k);
        let mut reference = vec![0f32; 2 * n];
        matmul_with(Isa::Portable, &w, &acts, &mut reference);
        let mut out = vec![0f32; 2 * n];
        panels.forward_rows(&x, 2, &mut out, None);
        for (a, b) in out.iter().zip(&reference) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
            assert!((a - sign * 62.0).abs() < 0.5, "{a}: 62 ones in two blocks");
        }
    }
}

/// The vector rounding is the portable one bit for bit: random blocks, blocks of exact
/// halves (ties round away from zero), zeros and one large value among small ones.
#[cfg(target_arch = "x86_64")]
#[test]
fn vector_quantisation_is_the_portable_rounding() {
    if Isa::detect() == Isa::Portable {
        return;
    }
    let mut blocks: Vec<Vec<f32>> = (0..200).map(|i| values(BLOCK, 40 + i)).collect();
    // amax 127 makes d = 1, so these are the values' own ties.
    blocks.push((0..BLOCK).map(|i| i as f32 - 15.5).collect());
    blocks.last_mut().unwrap()[0] = 127.0;
    blocks.push((0..BLOCK).map(|i| -(i as f32) - 0.5).collect());
    blocks.last_mut().unwrap()[31] = -127.0;
    blocks.push(vec![0.0; BLOCK]);
    blocks.push(
        (0..BLOCK)
            .map(|i| if i == 7 { 1e4 } else { 1e-3 * i as f32 })
            .collect(),
    );
    for x in &blocks {
        let (mut want, mut got) = ([0i8; BLOCK], [0i8; BLOCK]);
        let expected = quantize_block_body(x, &mut want);
        // SAFETY: the CPU has AVX2 and FMA (`Isa::detect`).
        let vector = unsafe { quantize_block_avx2(x[..].try_into().unwrap(), &mut got) };
        assert_eq!(got, want, "{x:?}");
        assert_eq!(vector.0.to_bits(), expected.0.to_bits());
        assert_eq!(vector.1, expected.1);
    }
}

/// Decode reads Q4_1 in panels exactly where the kernels run at the AVX2 level or above, and
/// Q8_0 in panels exactly where they run with VNNI (the test command runs this at each level
/// the CPU has); either way the product is the blocks-as-shipped one, the bytes held are the
/// file's, and the rows looked up are the rows as shipped.
#[test]
fn decode_takes_panels_where_their_kernel_runs() {
    let (rows, cols) = (40, 576);
    let q4 = DecodeMatrix::new(q4_matrix(rows, cols));
    let q8 = DecodeMatrix::new(QMatrix::quantize_q8(&values(rows * cols, 5), rows, cols));
    #[cfg(target_arch = "x86_64")]
    {
        assert_eq!(q4.panels().is_some(), Isa::detect() != Isa::Portable);
        assert_eq!(q8.panels().is_some(), Isa::detect() == Isa::Avx512Vnni);
    }
    assert_eq!(q4.size_in_bytes(), q4_matrix(rows, cols).size_in_bytes());
    let q8_shipped = QMatrix::quantize_q8(&values(rows * cols, 5), rows, cols);
    assert_eq!(q8.size_in_bytes(), q8_shipped.size_in_bytes());
    for (got, w) in [(&q4, q4_matrix(rows, cols)), (&q8, q8_shipped)] {
        let mut row = vec![0f32; cols];
        for (r, want) in dense_rows(&w).into_iter().enumerate() {
            got.dequantize_row(r, &mut row);
            assert_eq!(row, want, "row {r}");
        }
    }
    let x = values(3 * cols, 17);
    let mut acts = QActs::default();
    acts.quantize(&x, 3, cols);
    for (got, w) in [
        (&q4, q4_matrix(rows, cols)),
        (
            &q8,
            QMatrix::quantize_q8(&values(rows * cols, 5), rows, cols),
        ),
    ] {
        assert_eq!(got.rows(), rows);
        let (mut out, mut want) = (vec![0f32; 3 * rows], vec![0f32; 3 * rows]);
        got.matmul(&acts, &mut out);
        matmul_with(Isa::Portable, &w, &acts, &mut want);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}

/// The panels give back each row as shipped, bit for bit, in both formats: a partial last
/// group of columns, and Q8_0's extremes (-128 and 127, whose offset bytes are 0 and 255).
#[cfg(target_arch = "x86_64")]
#[test]
fn panels_give_back_the_rows_as_shipped() {
    let mut q8 = QMatrix::quantize_q8(&values(37 * 576, 9), 37, 576);
    q8.quants[..64].fill(0x80);
    q8.quants[64..128].fill(127);
    for w in [q4_matrix(37, 576), q8] {
        let panels = panels::Panels::pack(&w);
        let mut row = vec![0f32; w.cols()];
        for (r, want) in dense_rows(&w).into_iter().enumerate() {
            panels.dequantize_row(r, &mut row);
            assert_eq!(row, want, "{:?} row {r}", w.format());
        }
    }
}

/// Many rows are quantised over the thread pool, a few on the calling thread: the same values.
#[test]
fn quantising_over_the_pool_gives_the_serial_values() {
    let cols = 1536;
    let rows = PARALLEL_QUANTIZE_BLOCKS / (cols / BLOCK) + 3;
    let x = values(rows * cols, 23);
    let mut all = QActs::default();
    all.quantize(&x, rows, cols);
    assert!(rows * cols / BLOCK >= PARALLEL_QUANTIZE_BLOCKS);
    for r in [0, rows / 2, rows - 1] {
        let mut one = QActs::default();
        one.quantize(&x[r * cols..(r + 1) * cols], 1, cols);
        let (a, b) = (all.row(r), one.row(0));
        assert_eq!(a.q, b.q, "row {r}");
        assert_eq!(a.d, b.d, "row {r}");
        assert_eq!(a.s, b.s, "row {r}");
        assert_eq!(a.sum, b.sum, "row {r}");
    }
}

/// The VNNI panel kernel alone (the test command runs it only where the CPU has AVX-512).
#[cfg(target_arch = "x86_64")]
mod needs_avx512 {
    use super::*;
    use crate::cpu::Level;

    /// `vpdpbusd` adds the same integers as AVX2's 16-bit pairs, so the two panel kernels
    /// give the same bits: random weights, a partial last group, row counts around the
    /// register tile and past a work item, with the residual; and the largest block sums
    /// (nibbles of 15 against ±127, a row of each sign).
    #[test]
    fn vnni_panels_are_the_avx2_panels_bit_for_bit() {
        crate::cpu::require(Level::Avx512);
        let extreme = {
            let (n, k) = (8, 64);
            let dense: Vec<f32> = (0..n * k)
                .map(|i| if i % 32 == 5 { 0.0 } else { 1.0 })
                .collect();
            let t =
                candle_core::Tensor::from_vec(dense, (n, k), &candle_core::Device::Cpu).unwrap();
            QMatrix::from_qtensors(&[&QTensor::quantize(&t, GgmlDType::Q4_1).unwrap()]).unwrap()
        };
        let cases = [
            (q4_matrix(37, 576), None),
            (q4_matrix(300, 1536), None),
            (extreme, Some(1.0f32)),
        ];
        for (w, fill) in cases {
            let (n, k) = (w.rows(), w.cols());
            let panels = panels::Panels::pack(&w);
            for m in [1, 2, 3, 4, 5, 67] {
                let x = match fill {
                    Some(v) => (0..m * k)
                        .map(|i| if (i / k) % 2 == 0 { v } else { -v })
                        .collect(),
                    None => values(m * k, 31 + m as u64),
                };
                let mut acts = QActs::default();
                acts.quantize(&x, m, k);
                let residual = values(m * n, 5);
                let (mut avx2, mut vnni) = (vec![0f32; m * n], vec![0f32; m * n]);
                panels.matmul_with(Isa::Avx2, &acts, &mut avx2, Some(&residual));
                panels.matmul_with(Isa::Avx512Vnni, &acts, &mut vnni, Some(&residual));
                assert_eq!(vnni, avx2, "({n}, {k}) × {m} rows");
            }
        }
    }

    /// The Q8_0 panels (the output head) against the blocks kernel's arithmetic: to float
    /// rounding for random weights, a partial last group, row counts around the register tile
    /// and past a work item, with the residual, from f32 rows and from quantised ones; and, with
    /// one block per row (where the two kernels round the same way), the portable kernel's bits
    /// at the extremes: q of -128 and 127 (offset bytes 0 and 255) against ±127, the largest
    /// offset sums, so taking 128·Σq_a off in integers is exact.
    #[test]
    fn q8_panels_are_the_blocks_kernel() {
        crate::cpu::require(Level::Avx512);
        for (n, k) in [(37, 576), (300, 1536)] {
            let w = QMatrix::quantize_q8(&values(n * k, 41), n, k);
            let panels = panels::Panels::pack(&w);
            for m in [1, 2, 3, 4, 5, 67] {
                let x = values(m * k, 43 + m as u64);
                let mut acts = QActs::default();
                acts.quantize(&x, m, k);
                let mut reference = vec![0f32; m * n];
                matmul_with(Isa::Portable, &w, &acts, &mut reference);
                let mut blocks = vec![0f32; m * n];
                matmul_with(Isa::Avx512Vnni, &w, &acts, &mut blocks);
                let residual = values(m * n, 13);
                let (mut out, mut added) = (vec![0f32; m * n], vec![0f32; m * n]);
                panels.matmul(&acts, &mut out, None);
                panels.matmul(&acts, &mut added, Some(&residual));
                let mut from_f32 = vec![0f32; m * n];
                panels.forward_rows(&x, m, &mut from_f32, None);
                assert_eq!(from_f32, out, "({n}, {k}) × {m} rows: quantised first");
                for (i, &want) in reference.iter().enumerate() {
                    let what = format!("({n}, {k}) × {m} rows, output {i}");
                    let near = |got: f32| (got - want).abs() <= 1e-4 * (1.0 + want.abs());
                    assert!(near(out[i]), "{what}: {} vs {want}", out[i]);
                    assert!(near(blocks[i]), "{what}: blocks {} vs {want}", blocks[i]);
                    assert_eq!(added[i], out[i] + residual[i], "{what}: residual");
                }
            }
        }
        let (n, k) = (16, BLOCK);
        let mut w = QMatrix::quantize_q8(&values(n * k, 47), n, k);
        for (c, row) in w.quants.chunks_exact_mut(k).enumerate() {
            match c % 4 {
                0 => row.fill(0x80),
                1 => row.fill(127),
                2 => row.iter_mut().enumerate().for_each(|(i, q)| {
                    *q = if i % 2 == 0 { 0x80 } else { 127 };
                }),
                _ => {}
            }
        }
        let panels = panels::Panels::pack(&w);
        let m = 4;
        let x: Vec<f32> = (0..m * k)
            .map(|i| match i / k {
                0 => 1.0,
                1 => -1.0,
                2 => [1.0, -1.0][i % 2],
                _ => values(1, i as u64)[0],
            })
            .collect();
        let mut acts = QActs::default();
        acts.quantize(&x, m, k);
        assert_eq!(acts.row(0).sum[0], 127 * 32);
        assert_eq!(acts.row(1).sum[0], -127 * 32);
        let (mut want, mut got) = (vec![0f32; m * n], vec![0f32; m * n]);
        matmul_with(Isa::Portable, &w, &acts, &mut want);
        panels.matmul(&acts, &mut got, None);
        assert_eq!(got, want, "one block per row");
    }
}
