//! The kernels against their definitions, in f64, and the dispatched paths against the portable
//! ones: run at each level the CPU has (`RAGSCOPE_CPU_LEVEL`), that is each path. The BF16
//! kernels' own tests are in `needs_avx512bf16`, the AMX ones' in `needs_amx` (and their
//! addressing on emulated tiles, here, on any CPU).

use super::activation::silu_mul_body;
#[cfg(target_arch = "x86_64")]
use super::activation::x86;
use super::amx::Emulated;
use super::attention::attention_head_body;
use super::norm::layer_norm_body;
use super::*;

/// Deterministic values in [-1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn naive(a: &[f32], w: &[f32], bias: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0f64; m * n];
    for r in 0..m {
        for c in 0..n {
            out[r * n + c] = f64::from(bias[c])
                + (0..k)
                    .map(|i| f64::from(a[r * k + i]) * f64::from(w[c * k + i]))
                    .sum::<f64>();
        }
    }
    out
}

fn gelu_f64(x: f64) -> f64 {
    // Beyond 5.5, x Φ(x) is within 1e-7 of max(x, 0); below, erf by its Taylor series,
    // which f64 sums with ~1e-10 to spare.
    if x.abs() > 5.5 {
        return x.max(0.0);
    }
    let z = x / std::f64::consts::SQRT_2;
    let mut term = z;
    let mut erf = z;
    for n in 1..200 {
        term *= -z * z / n as f64;
        erf += term / (2 * n + 1) as f64;
    }
    0.5 * x * (1.0 + erf * 2.0 / std::f64::consts::PI.sqrt())
}

/// Runs `layer` over `a` in `parts` column shares, as the forward's threads do.
fn run(layer: &Linear, a: &[f32], m: usize, epilogue: Epilogue<'_>, parts: usize) -> Vec<f32> {
    let n = layer.out_features();
    let mut out = vec![f32::NAN; m * n];
    let bf;
    let rows = match layer.precision() {
        Precision::Bf16 => {
            bf = a.iter().map(|&x| to_bf16(x)).collect::<Vec<_>>();
            Rows::Bf16(&bf)
        }
        Precision::F32 => Rows::F32(a),
    };
    for part in 0..parts {
        let cols = column_share(n, part, parts);
        // SAFETY: out is [m, n] and only this call touches it.
        unsafe { layer.forward_columns(rows, m, out.as_mut_ptr(), cols, epilogue) };
    }
    out
}

fn check_linear(precision: Precision, m: usize, n: usize, k: usize) {
    let layer = Linear::new(&values(n * k, 2), &values(n, 3), n, k, precision);
    assert_eq!(layer.precision(), precision);
    check_product(
        precision == Precision::Bf16,
        m,
        n,
        k,
        &|a, epilogue, parts| run(&layer, a, m, epilogue, parts),
    );
}

/// `multiply(a, epilogue, parts)`, a `[m, k] × [k, n]` product with weights `values(n * k, 2)`
/// and bias `values(n, 3)` computed in `parts` column shares, against the naive product in
/// f64 of the operands the kernel sees (BF16-rounded with `bf16`), with each epilogue.
type Multiply<'a> = dyn Fn(&[f32], Epilogue<'_>, usize) -> Vec<f32> + 'a;

fn check_product(bf16: bool, m: usize, n: usize, k: usize, multiply: &Multiply<'_>) {
    let a = values(m * k, 1);
    let w = values(n * k, 2);
    let bias = values(n, 3);
    let residual = values(m * n, 4);
    let round = |v: &[f32]| -> Vec<f32> {
        if bf16 {
            v.iter().map(|&x| from_bf16(to_bf16(x))).collect()
        } else {
            v.to_vec()
        }
    };
    let want = naive(&round(&a), &round(&w), &bias, m, n, k);
    let tol = 1e-5 * k as f64;
    for parts in [1, 2, 3] {
        let plain = multiply(&a, Epilogue::None, parts);
        let added = multiply(&a, Epilogue::Add(&residual), parts);
        let gelu = multiply(&a, Epilogue::Gelu, parts);
        for i in 0..m * n {
            let (r, c) = (i / n, i % n);
            let at = format!("bf16={bf16} m={m} n={n} k={k} parts={parts} [{r},{c}]");
            assert!(
                (f64::from(plain[i]) - want[i]).abs() < tol,
                "{at}: {} vs {}",
                plain[i],
                want[i]
            );
            let sum = want[i] + f64::from(residual[i]);
            assert!(
                (f64::from(added[i]) - sum).abs() < tol,
                "{at}: {} vs {sum}",
                added[i]
            );
            let g = gelu_f64(want[i]);
            assert!(
                (f64::from(gelu[i]) - g).abs() < tol,
                "{at}: {} vs {g}",
                gelu[i]
            );
        }
    }
}

/// The AMX kernel on `tiles`: weights `values(n * k, 2)` packed in panels, `a` rounded to
/// BF16, in `parts` column shares, each share a call of its own (as each pool thread makes).
fn on_tiles<T: amx::Tiles>(
    tiles: &mut T,
    a: &[f32],
    (m, n, k): (usize, usize, usize),
    epilogue: Epilogue<'_>,
    parts: usize,
) -> Vec<f32> {
    let packed = bf16::pack_panels(&values(n * k, 2), n, k);
    let rows = a.iter().map(|&x| to_bf16(x)).collect::<Vec<_>>();
    let bias = values(n, 3);
    let mut out = vec![f32::NAN; m * n];
    for part in 0..parts {
        let cols = column_share(n, part, parts);
        // SAFETY: k is whole tile steps; `out` is [m, n] and only this call touches it.
        unsafe {
            amx::gemm(
                tiles,
                &rows,
                m,
                k,
                &packed,
                &bias,
                n,
                out.as_mut_ptr(),
                cols,
                epilogue,
            )
        };
    }
    out
}

#[test]
fn f32_linear_matches_a_naive_product() {
    for (m, n, k) in [(1, 64, 2), (7, 128, 30), (13, 192, 384), (3, 100, 17)] {
        check_linear(Precision::F32, m, n, k);
    }
}

#[test]
fn bf16_needs_whole_panels_and_even_k_else_stays_f32() {
    let w = values(100 * 3, 5);
    let b = values(100, 6);
    assert_eq!(
        Linear::new(&w, &b, 100, 3, Precision::Bf16).precision(),
        Precision::F32
    );
}

#[test]
fn column_shares_cover_the_columns_once_in_whole_panels() {
    for (n, parts) in [(384, 2), (1152, 2), (1536, 3), (100, 2), (64, 2)] {
        let mut next = 0;
        for part in 0..parts {
            let share = column_share(n, part, parts);
            assert_eq!(share.start, next, "n={n} parts={parts}");
            assert!(share.start.is_multiple_of(PANEL));
            next = share.end;
        }
        assert_eq!(next, n);
    }
}

#[test]
fn bf16_rounding_is_to_nearest_even_and_the_vector_path_agrees() {
    assert_eq!(to_bf16(1.0), 0x3f80);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
    assert_eq!(to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
    assert_eq!(to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
    assert_eq!(from_bf16(to_bf16(-2.5)), -2.5);
    let src = values(100, 7);
    let mut dst = vec![0u16; 100];
    convert_to_bf16(&src, &mut dst);
    for (s, d) in src.iter().zip(&dst) {
        assert_eq!(*d, to_bf16(*s), "{s}");
    }
}

#[test]
fn exp_and_gelu_are_accurate() {
    for i in -800..=800 {
        let x = i as f32 / 10.0;
        let want = f64::from(x).exp();
        let got = f64::from(exp(x));
        assert!(
            (got - want).abs() <= 5e-7 * want + 1e-37,
            "exp({x}) = {got}, want {want}"
        );
    }
    for i in -600..=600 {
        let x = i as f32 / 100.0;
        let want = gelu_f64(f64::from(x));
        assert!(
            (f64::from(gelu(x)) - want).abs() < 3e-7 * (1.0 + x.abs() as f64),
            "gelu({x})"
        );
    }
}

/// The F32 GEMM's GELU epilogue is `gelu` element by element, bit for bit, on the AVX2-compiled
/// loop and the baseline one alike (ties in `exp`'s rounding included: x = ±k·ln2 / 2).
#[test]
fn the_exact_gelu_loop_is_gelu_bit_for_bit() {
    let mut xs: Vec<f32> = (-1200..=1200).map(|i| i as f32 / 100.0).collect();
    xs.extend((-40..=40).map(|k| k as f32 * std::f32::consts::LN_2 / 2.0));
    xs.extend([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0]);
    let mut got = xs.clone();
    super::activation::gelu_exact_in_place(&mut got);
    for (x, g) in xs.iter().zip(&got) {
        assert_eq!(g.to_bits(), gelu(*x).to_bits(), "gelu({x})");
    }
}

#[test]
fn silu_mul_matches_the_definition() {
    // 203 values: whole 16-lane vectors and a tail, from -30 to 30.
    let gate: Vec<f32> = (0..203).map(|i| (i as f32 - 101.0) * 0.3).collect();
    let up = values(gate.len(), 13);
    let mut out = vec![0f32; gate.len()];
    let mut portable = vec![0f32; gate.len()];
    silu_mul(&gate, &up, &mut out);
    silu_mul_body(&gate, &up, &mut portable);
    for (i, (&g, &u)) in gate.iter().zip(&up).enumerate() {
        let (g64, u64) = (f64::from(g), f64::from(u));
        let want = g64 / (1.0 + (-g64).exp()) * u64;
        for (got, path) in [(out[i], "dispatched"), (portable[i], "portable")] {
            assert!(
                (f64::from(got) - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{path} silu({g}) * {u} = {got}, want {want}"
            );
        }
    }
}

#[test]
fn layer_norm_matches_the_definition() {
    let width = 384;
    let x = values(3 * width, 8);
    let gamma = values(width, 9);
    let beta = values(width, 10);
    let mut out = vec![0f32; x.len()];
    let mut bf = vec![0u16; x.len()];
    let mut portable = vec![0f32; x.len()];
    layer_norm_body(&x, &gamma, &beta, 1e-12, &mut portable, None);
    layer_norm(&x, &gamma, &beta, 1e-12, &mut out, Some(&mut bf));
    for (a, b) in out.iter().zip(&portable) {
        assert!((a - b).abs() < 1e-6, "{a} vs the portable {b}");
    }
    for r in 0..3 {
        let row: Vec<f64> = x[r * width..(r + 1) * width]
            .iter()
            .map(|&v| f64::from(v))
            .collect();
        let mean = row.iter().sum::<f64>() / width as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / width as f64;
        for c in 0..width {
            let want =
                (row[c] - mean) / (var + 1e-12).sqrt() * f64::from(gamma[c]) + f64::from(beta[c]);
            let got = out[r * width + c];
            assert!(
                (f64::from(got) - want).abs() < 1e-5,
                "[{r},{c}] {got} vs {want}"
            );
            assert_eq!(bf[r * width + c], to_bf16(got));
        }
    }
}

#[test]
fn attention_head_matches_the_definition() {
    // Shorter and longer than a register of keys, a whole one, and a head width with no
    // vector path (24); the dispatched kernel and, where that is AVX-512, the portable body;
    // every query against every key, and causal with fewer queries than keys.
    for (len, d) in [(9, 32), (37, 32), (16, 64), (1, 16), (5, 24), (70, 64)] {
        let len: usize = len;
        for queries in [len, len.div_ceil(3)] {
            check_attention(len, queries, d, attention_head);
            check_attention(len, queries, d, |head, scale, out, scratch| {
                attention_head_body(head, None, scale, out, scratch)
            });
        }
    }
}

type Attention = fn(&Head<'_>, f32, &mut [f32], &mut Vec<f32>);

/// `keys` positions of three heads in one `[q | k | v]` buffer; the last `queries` of them
/// query, causally when they are fewer than the keys (else each sees every key), against
/// the definition in f64.
fn check_attention(keys: usize, queries: usize, d: usize, attention: Attention) {
    let heads = 3;
    let ld = 3 * heads * d;
    let qkv = values(keys * ld, 11)
        .iter()
        .map(|v| v * 4.0)
        .collect::<Vec<_>>();
    let scale = 1.0 / (d as f32).sqrt();
    let causal = queries < keys;
    let first = keys - queries;
    let mut scratch = Vec::new();
    for h in 0..heads {
        let cols = (h * d, heads * d + h * d, 2 * heads * d + h * d);
        let at = |data, offset| HeadRows {
            data,
            stride: ld,
            offset,
        };
        let head = Head {
            q: at(&qkv[first * ld..], cols.0),
            k: at(&qkv, cols.1),
            v: at(&qkv, cols.2),
            queries,
            keys,
            causal,
        };
        let mut out = vec![0f32; queries * d];
        attention(&head, scale, &mut out, &mut scratch);
        for i in 0..queries {
            let seen = if causal { first + i + 1 } else { keys };
            let q = (first + i) * ld + cols.0;
            let s: Vec<f64> = (0..seen)
                .map(|j| {
                    (0..d)
                        .map(|e| f64::from(qkv[q + e]) * f64::from(qkv[j * ld + cols.1 + e]))
                        .sum::<f64>()
                        * f64::from(scale)
                })
                .collect();
            let max = s.iter().cloned().fold(f64::MIN, f64::max);
            let total: f64 = s.iter().map(|x| (x - max).exp()).sum();
            for e in 0..d {
                let want: f64 = (0..seen)
                    .map(|j| (s[j] - max).exp() / total * f64::from(qkv[j * ld + cols.2 + e]))
                    .sum();
                let got = out[i * d + e];
                assert!(
                    (f64::from(got) - want).abs() < 1e-5,
                    "keys {keys} queries {queries} d {d} head {h} [{i},{e}] {got} vs {want}"
                );
            }
        }
    }
}

/// Queries `from..to` of rows `[q | k | v]` (each `d` wide) in `data`, causal over keys `..to`.
fn causal_head(data: &[f32], d: usize, from: usize, to: usize) -> Head<'_> {
    let at = |data, offset| HeadRows {
        data,
        stride: 3 * d,
        offset,
    };
    Head {
        q: at(&data[from * 3 * d..], 0),
        k: at(data, d),
        v: at(data, 2 * d),
        queries: to - from,
        keys: to,
        causal: true,
    }
}

#[test]
fn attention_over_shared_transposed_keys_is_the_same_bit_for_bit() {
    // As a prefill uses it: one transposition of all of a KV head's keys, read by causal blocks
    // of queries that each see fewer keys; on the dispatched kernel and the portable body.
    for (keys, d) in [(70, 64), (33, 32), (5, 24), (100, 16)] {
        let data = values(keys * 3 * d, 13);
        let mut kt = Vec::new();
        let padded = transpose_keys(causal_head(&data, d, 0, keys).k, keys, d, &mut kt);
        let keys_t = KeysT {
            data: &kt,
            keys,
            padded,
        };
        for (from, to) in [(0, keys), (keys / 3, keys / 2 + 1), (keys - 1, keys)] {
            let head = causal_head(&data, d, from, to);
            let mut want = vec![0f32; (to - from) * d];
            attention_head(&head, 0.125, &mut want, &mut Vec::new());
            let mut got = vec![1f32; want.len()];
            attention_head_over(&head, keys_t, 0.125, &mut got, &mut Vec::new());
            assert_eq!(got, want, "keys {keys} d {d} queries {from}..{to}");
            let mut want = vec![0f32; want.len()];
            attention_head_body(&head, None, 0.125, &mut want, &mut Vec::new());
            let mut got = vec![1f32; want.len()];
            attention_head_body(&head, Some(keys_t), 0.125, &mut got, &mut Vec::new());
            assert_eq!(
                got, want,
                "portable: keys {keys} d {d} queries {from}..{to}"
            );
        }
    }
}

#[test]
fn a_causal_query_gives_the_same_result_whatever_shares_its_call() {
    // What chunked prefill relies on: query 20 of 40 alone, or among queries 8..40.
    let (keys, d) = (40, 64);
    let data = values(keys * 3 * d, 12);
    let run = |from: usize, to: usize| {
        let head = causal_head(&data, d, from, to);
        let mut out = vec![0f32; (to - from) * d];
        attention_head(&head, 0.125, &mut out, &mut Vec::new());
        out
    };
    let alone = run(20, 21);
    let among = run(8, 40);
    assert_eq!(alone[..], among[12 * d..13 * d]);
}

/// The AMX kernel's addressing, shapes and epilogues, on the tiles emulated as the Intel SDM
/// defines each instruction (with the CPU's shape checks): every row count around the 16-row
/// tile and the 32-row block, one to three panels in one to three column shares, one tile
/// step of inputs and many. The instructions themselves run in `needs_amx`.
#[test]
fn amx_kernel_on_emulated_tiles_matches_a_naive_product() {
    for (m, n, k) in [
        (1, 64, 32),
        (15, 128, 64),
        (16, 64, 32),
        (17, 192, 96),
        (32, 64, 64),
        (45, 128, 576),
        (70, 64, 32),
    ] {
        let tiles = std::cell::RefCell::new(Emulated::new());
        check_product(true, m, n, k, &|a, epilogue, parts| {
            on_tiles(&mut *tiles.borrow_mut(), a, (m, n, k), epilogue, parts)
        });
        // Per call: a configuration for the full blocks and one for a shorter last block,
        // four tile products per step of a full block, and the tiles released at the end.
        let [configured, _, dots, _, released] = tiles.into_inner().counts;
        let calls = 3 * (1 + 2 + 3);
        assert_eq!(released, calls, "m={m} n={n} k={k}");
        assert!(configured >= calls && configured <= 2 * calls);
        let per_block = |rows: usize| k / amx::STEP * if rows > 16 { 4 } else { 2 };
        let blocks: usize = (0..m).step_by(32).map(|r| per_block((m - r).min(32))).sum();
        // Every epilogue covers all columns once per share count: 3 × 3 times.
        assert_eq!(dots, 9 * blocks * n / 32, "m={m} n={n} k={k}");
    }
}

/// A row's outputs on tiles do not depend on the rows beside it: a prompt's rows in one call
/// and in chunks of other sizes are the same bits (what chunked prefill relies on).
#[test]
fn amx_rows_are_the_same_in_any_chunking() {
    let (m, n, k) = (77, 128, 96);
    let a = values(m * k, 9);
    let whole = on_tiles(&mut Emulated::new(), &a, (m, n, k), Epilogue::None, 2);
    let mut chunked = Vec::new();
    for (r0, r1) in [(0, 5), (5, 38), (38, 77)] {
        let part = &a[r0 * k..r1 * k];
        chunked.extend(on_tiles(
            &mut Emulated::new(),
            part,
            (r1 - r0, n, k),
            Epilogue::None,
            1,
        ));
    }
    assert_eq!(whole, chunked);
}

/// A thread that had a tile configuration of its own (candle's AMX matmuls keep one on their
/// pool threads) has it back after the kernel ran; one that had none is left released.
#[test]
fn a_threads_own_tile_configuration_is_put_back() {
    let (m, n, k) = (20, 64, 64);
    let a = values(m * k, 3);
    let mut tiles = Emulated::new();
    let theirs = amx::TileConfig::for_rows(8, 0);
    // SAFETY: the emulation checks the configuration itself.
    unsafe { amx::Tiles::configure(&mut tiles, &theirs) };
    on_tiles(&mut tiles, &a, (m, n, k), Epilogue::None, 1);
    assert_eq!(tiles.config(), Some(theirs));
    let mut fresh = Emulated::new();
    on_tiles(&mut fresh, &a, (m, n, k), Epilogue::None, 1);
    assert_eq!(fresh.config(), None);
}

/// The emulation refuses what the CPU would fault on, so a kernel that forgot its
/// configuration cannot pass on it.
#[test]
#[should_panic(expected = "before ldtilecfg")]
fn emulated_tiles_refuse_an_instruction_before_the_configuration() {
    let row = [0u8; 64];
    // SAFETY: the emulation reads `row` only after the configuration it panics without.
    unsafe { amx::Tiles::load(&mut Emulated::new(), 4, row.as_ptr(), 64) };
}

/// The AVX-512 BF16 kernels alone: the test command runs these only where the CPU has them
/// (elsewhere they show as skipped), and each fails rather than passes on a CPU without them.
#[cfg(target_arch = "x86_64")]
mod needs_avx512bf16 {
    use super::*;
    use crate::cpu::Level;

    #[test]
    fn bf16_linear_matches_a_naive_product_of_the_rounded_operands() {
        crate::cpu::require(Level::Avx512Bf16);
        // Every tile height (1..=6 rows and a tail), one and several panels, short and long k.
        for (m, n, k) in [
            (1, 64, 2),
            (5, 128, 30),
            (6, 64, 384),
            (13, 192, 384),
            (27, 384, 1536),
        ] {
            check_linear(Precision::Bf16, m, n, k);
        }
    }

    #[test]
    fn the_vector_gelu_is_as_accurate_as_the_scalar_one() {
        crate::cpu::require(Level::Avx512Bf16);
        for i in -600..=600 {
            let x = i as f32 / 100.0;
            let want = gelu_f64(f64::from(x));
            let v = x86::gelu16([x; 16]);
            assert!(
                (f64::from(v[3]) - want).abs() < 3e-7 * (1.0 + x.abs() as f64),
                "gelu16({x})"
            );
        }
    }
}

/// The AMX kernels alone, on the instructions themselves: run only where the CPU has AMX and the
/// operating system granted the tiles (elsewhere skipped; run anyway, they fail).
#[cfg(target_arch = "x86_64")]
mod needs_amx {
    use super::*;
    use crate::cpu::Level;

    #[test]
    fn amx_linear_matches_a_naive_product_of_the_rounded_operands() {
        crate::cpu::require(Level::Amx);
        for (m, n, k) in [
            (1, 64, 32),
            (15, 128, 64),
            (17, 192, 384),
            (45, 384, 1536),
            (96, 64, 576),
        ] {
            assert!(
                Linear::new(&values(n * k, 2), &values(n, 3), n, k, Precision::Bf16).on_tiles()
            );
            check_linear(Precision::Bf16, m, n, k);
        }
    }

    /// The instructions against their emulation: the same operands and the same order of
    /// steps, so only the order of the sums inside one `tdpbf16ps` may differ.
    #[test]
    fn amx_instructions_agree_with_their_emulation() {
        crate::cpu::require(Level::Amx);
        let (m, n, k) = (45, 128, 576);
        let a = values(m * k, 7);
        let hardware = on_tiles(&mut amx::Hardware, &a, (m, n, k), Epilogue::None, 2);
        let emulated = on_tiles(&mut Emulated::new(), &a, (m, n, k), Epilogue::None, 2);
        let worst = hardware
            .iter()
            .zip(&emulated)
            .map(|(h, e)| (h - e).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "AMX against its emulation: max |Δ| {worst} over {} outputs",
            m * n
        );
        // The bound `check_product` holds every kernel to against the exact product.
        assert!(f64::from(worst) < 2e-5 * k as f64, "max |Δ| {worst}");
    }

    /// On the instructions too, a row's outputs do not depend on the rows beside it.
    #[test]
    fn amx_rows_are_the_same_in_any_chunking_on_the_instructions() {
        crate::cpu::require(Level::Amx);
        let (m, n, k) = (77, 128, 96);
        let a = values(m * k, 9);
        let whole = on_tiles(&mut amx::Hardware, &a, (m, n, k), Epilogue::None, 2);
        let mut chunked = Vec::new();
        for (r0, r1) in [(0, 5), (5, 38), (38, 77)] {
            let part = &a[r0 * k..r1 * k];
            chunked.extend(on_tiles(
                &mut amx::Hardware,
                part,
                (r1 - r0, n, k),
                Epilogue::None,
                1,
            ));
        }
        assert_eq!(whole, chunked);
    }

    /// Fresh threads, none of which has run a tile instruction before, each multiply at once:
    /// each loads its own configuration (the SIGILL llama.cpp's AMX build dies of is a pool
    /// thread's first tile instruction without one).
    #[test]
    fn fresh_threads_each_configure_their_own_tiles() {
        crate::cpu::require(Level::Amx);
        let (m, n, k) = (40, 256, 576);
        let layer = Linear::new(&values(n * k, 2), &values(n, 3), n, k, Precision::Bf16);
        assert!(layer.on_tiles());
        let a = values(m * k, 1);
        let alone = run(&layer, &a, m, Epilogue::None, 1);
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| run(&layer, &a, m, Epilogue::None, 4)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            assert_eq!(r, alone);
        }
    }
}
