//! The instruction sets the CPU kernels run on: detected once at run time, so one portable
//! binary uses what each machine has, and capped by `--cpu-level` (`RAGSCOPE_CPU_LEVEL`), so
//! every slower path can be run, and tested, on a faster machine. Every kernel that dispatches
//! asks [`level`]; nothing else reads the CPU's features.
//!
//! The levels, each a superset of the one before:
//! - `portable`: plain Rust, any CPU;
//! - `avx2`: AVX2 with FMA and F16C (x86-64 from about 2013 on);
//! - `avx512`: AVX-512 F, BW, VL, DQ and VNNI (the decode's 8-bit dot products);
//! - `avx512bf16`: also AVX-512 BF16 (the BF16 matrix multiplies and the AVX-512 row kernels);
//! - `amx`: also AMX tiles with BF16 (the BF16 matrix multiplies on tiles), granted to this
//!   process by the operating system (Linux asks each process to request the tile state).

use std::sync::OnceLock;

/// The variable the cap is read from when no `--cpu-level` set it first.
pub const ENV: &str = "RAGSCOPE_CPU_LEVEL";

/// An instruction-set level of the kernels, slowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Level {
    Portable,
    Avx2,
    Avx512,
    Avx512Bf16,
    Amx,
}

impl Level {
    /// Every level, slowest first.
    pub const ALL: [Level; 5] = [
        Level::Portable,
        Level::Avx2,
        Level::Avx512,
        Level::Avx512Bf16,
        Level::Amx,
    ];

    /// The name `--cpu-level` takes and logs print.
    pub fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Avx512Bf16 => "avx512bf16",
            Level::Amx => "amx",
        }
    }

    /// The level called `name`.
    pub fn named(name: &str) -> Option<Level> {
        Level::ALL.into_iter().find(|l| l.name() == name.trim())
    }

    /// The CPU features this level needs, as `/proc/cpuinfo` spells them.
    pub fn features(self) -> &'static [&'static str] {
        match self {
            Level::Portable => &[],
            Level::Avx2 => &["avx2", "fma", "f16c"],
            Level::Avx512 => &["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"],
            Level::Avx512Bf16 => &["avx512_bf16"],
            Level::Amx => &["amx_tile", "amx_bf16"],
        }
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The best level this CPU (and its operating system) supports.
pub fn detected() -> Level {
    static DETECTED: OnceLock<Level> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    use std::arch::is_x86_feature_detected as has;
    if !(has!("avx2") && has!("fma") && has!("f16c")) {
        return Level::Portable;
    }
    let avx512 = has!("avx512f")
        && has!("avx512bw")
        && has!("avx512vl")
        && has!("avx512dq")
        && has!("avx512vnni");
    match (avx512, has!("avx512bf16")) {
        (false, _) => Level::Avx2,
        (true, false) => Level::Avx512,
        (true, true) if amx::granted() => Level::Amx,
        (true, true) => Level::Avx512Bf16,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Level {
    Level::Portable
}

/// AMX: whether the CPU has the tiles, and whether the operating system granted them.
pub mod amx {
    use std::sync::OnceLock;

    /// What became of AMX in this process.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Tiles {
        /// The CPU has no AMX tiles with BF16 (CPUID leaf 7, EDX bits 24 and 22).
        Absent,
        /// The CPU has them, and the kernel granted the tile state: the AMX kernels can run.
        Granted,
        /// The CPU has them, but the request for the tile state failed (why, in words): an
        /// older kernel, a sandbox that filters `arch_prctl`, or a thread whose signal stack is
        /// too small for the tile state. The kernels run at `avx512bf16`.
        Refused(String),
    }

    /// What [`request`] found, once per process; it asks only where CPUID shows the tiles.
    pub fn state() -> &'static Tiles {
        static STATE: OnceLock<Tiles> = OnceLock::new();
        STATE.get_or_init(|| {
            if cpu_has_tiles() {
                request()
            } else {
                Tiles::Absent
            }
        })
    }

    /// Whether the AMX kernels can run in this process.
    pub fn granted() -> bool {
        *state() == Tiles::Granted
    }

    #[cfg(target_arch = "x86_64")]
    fn cpu_has_tiles() -> bool {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        if __cpuid(0).eax < 7 {
            return false; // no structured-features leaf
        }
        let edx = __cpuid_count(7, 0).edx;
        const AMX_BF16: u32 = 1 << 22;
        const AMX_TILE: u32 = 1 << 24;
        edx & AMX_BF16 != 0 && edx & AMX_TILE != 0
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn cpu_has_tiles() -> bool {
        false
    }

    /// Asks Linux for the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`): it is
    /// granted per process, to every thread at once, and reads back as permitted afterwards.
    /// Without it the first tile instruction of any thread dies of SIGILL.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    pub fn request() -> Tiles {
        const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these codes reads and writes only the u64 passed.
        let asked = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        if asked != 0 {
            return Tiles::Refused(format!(
                "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut permitted: u64 = 0;
        // SAFETY: as above.
        let read = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_GET_XCOMP_PERM,
                &mut permitted as *mut u64,
            )
        };
        if read != 0 || permitted & (1 << XFEATURE_XTILEDATA) == 0 {
            return Tiles::Refused(format!(
                "the tile state reads back as not permitted ({permitted:#x})"
            ));
        }
        Tiles::Granted
    }

    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    pub fn request() -> Tiles {
        Tiles::Refused("the tile state is only requested on Linux".into())
    }

    /// A phrase for [`super::describe`]: nothing where the CPU has no AMX.
    pub fn describe() -> String {
        match state() {
            Tiles::Absent => String::new(),
            Tiles::Granted => "; AMX tiles granted".into(),
            Tiles::Refused(why) => format!("; AMX present but not usable ({why})"),
        }
    }
}

/// The cap in force: `--cpu-level`'s if it came first, else `RAGSCOPE_CPU_LEVEL`'s, else none.
static CAP: OnceLock<Option<Level>> = OnceLock::new();

fn cap() -> Option<Level> {
    *CAP.get_or_init(|| match std::env::var(ENV) {
        Ok(v) if v.trim().is_empty() => None,
        Ok(v) => Some(Level::named(&v).unwrap_or_else(|| {
            panic!("{ENV}={v:?}: expected one of portable, avx2, avx512, avx512bf16, amx")
        })),
        Err(_) => None,
    })
}

/// Caps the level at `level` (the `--cpu-level` flag, before any kernel runs). A cap already
/// in force, different from this one, is an error: kernels may have run at it.
pub fn set_cap(level: Option<Level>) -> Result<(), String> {
    let now = *CAP.get_or_init(|| level);
    if now == level {
        Ok(())
    } else {
        Err(format!(
            "the CPU level is already capped at {}",
            now.map_or("none", Level::name)
        ))
    }
}

/// The level the kernels run at: the CPU's best, capped.
pub fn level() -> Level {
    cap().map_or(detected(), |c| c.min(detected()))
}

/// Whether the kernels run at `at_least` or above.
pub fn has(at_least: Level) -> bool {
    level() >= at_least
}

/// The levels this CPU can run, best first: the ones the tests should each be run at.
pub fn runnable() -> Vec<Level> {
    Level::ALL
        .into_iter()
        .rev()
        .filter(|l| *l <= detected())
        .collect()
}

/// The CPU's model and family as `/proc/cpuinfo` names them (`AMD EPYC (family 25)`), for
/// printing beside a measured figure: the machines under these figures change.
pub fn model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    match (field("model name"), field("cpu family")) {
        (Some(name), Some(family)) => format!("{name} (family {family})"),
        (Some(name), None) => name,
        _ => "an unnamed CPU".to_string(),
    }
}

/// One line for logs and test output: the level in force, the CPU's best and the cap.
pub fn describe() -> String {
    let capped = match cap() {
        Some(c) if c < detected() => format!(" (capped by {ENV} or --cpu-level)"),
        _ => String::new(),
    };
    format!(
        "CPU kernels at {}{capped}; this CPU runs {}{}",
        level(),
        runnable()
            .iter()
            .map(|l| l.name())
            .collect::<Vec<_>>()
            .join(", "),
        amx::describe()
    )
}

/// The tests of one level's kernels: the level their CPU must run, checked at the start.
/// The test command leaves a test of a level above the one in force out of the run (so it
/// shows as skipped); run anyway, it fails here instead of passing without testing anything.
#[cfg(test)]
pub(crate) fn require(at_least: Level) {
    assert!(
        has(at_least),
        "this test needs the {at_least} kernels, but they run at {} here ({}); the test command \
         skips it on such a CPU",
        level(),
        describe()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_order_and_parse_by_name() {
        assert!(Level::Portable < Level::Avx2 && Level::Avx512 < Level::Avx512Bf16);
        assert!(Level::Avx512Bf16 < Level::Amx);
        for l in Level::ALL {
            assert_eq!(Level::named(l.name()), Some(l));
        }
        assert_eq!(Level::named("sse2"), None);
        assert!(level() <= detected());
        assert_eq!(runnable()[0], detected());
        assert_eq!(*runnable().last().unwrap(), Level::Portable);
    }

    fn cpuinfo_has(flag: &str) -> bool {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        info.lines()
            .find(|l| l.starts_with("flags"))
            .is_some_and(|l| l.split_whitespace().any(|f| f == flag))
    }

    /// The tiles are asked for exactly where the CPU lists them, and the AMX level is detected
    /// exactly where they were granted (on a CPU with the AVX-512 BF16 level below it).
    #[test]
    fn amx_is_asked_for_only_where_the_cpu_has_it_and_the_level_follows_the_answer() {
        let listed = cpuinfo_has("amx_tile") && cpuinfo_has("amx_bf16");
        let state = amx::state();
        eprintln!("AMX in /proc/cpuinfo: {listed}; {state:?}; {}", describe());
        assert_eq!(*state != amx::Tiles::Absent, listed, "{state:?}");
        assert_eq!(
            detected() == Level::Amx,
            amx::granted() && cpuinfo_has("avx512_bf16"),
            "{}",
            describe()
        );
    }

    /// The request itself, made again: granted where the CPU has AMX (asking twice is
    /// harmless), and elsewhere refused by the kernel with a reason, the process unharmed.
    #[test]
    fn the_tile_request_is_answered_either_way() {
        match amx::request() {
            amx::Tiles::Granted => assert!(cpuinfo_has("amx_tile")),
            amx::Tiles::Refused(why) => {
                eprintln!("refused: {why}");
                assert!(
                    why.contains("arch_prctl") || why.contains("not permitted"),
                    "{why}"
                );
                assert!(!amx::granted());
            }
            amx::Tiles::Absent => unreachable!("`request` asks; it does not read CPUID"),
        }
    }

    /// The test command computes the CPU's level from `/proc/cpuinfo` to choose what to run;
    /// it passes its reading here, and the kernels' own detection must agree with it.
    #[test]
    fn detection_agrees_with_the_test_commands_reading() {
        let Ok(expected) = std::env::var("RAGSCOPE_EXPECT_CPU_LEVEL") else {
            return; // not run by the test command: nothing to compare
        };
        assert_eq!(detected().name(), expected.trim(), "{}", describe());
        if let Ok(capped) = std::env::var(ENV) {
            assert_eq!(level().name(), capped.trim(), "{}", describe());
        }
    }
}
