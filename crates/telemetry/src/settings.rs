//! Telemetry's own settings, flattened into every subcommand of the binary (they are global
//! flags), and the value parsers they share with the other crates' settings. The exporters read
//! the standard `OTEL_*` variables themselves.

use std::time::Duration;

use clap::Args;

/// Telemetry settings of our own; the exporters read the standard `OTEL_*` variables themselves.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Telemetry")]
pub struct TelemetryArgs {
    /// Pyroscope server to send CPU profiles to (e.g. http://pyroscope:4040); unset = no
    /// profiling.
    #[arg(long, global = true, env = "RAGSCOPE_PYROSCOPE_URL")]
    pub pyroscope_url: Option<String>,
    /// The Pyroscope agents' own variable for the server, used when --pyroscope-url is unset.
    #[arg(long, global = true, env = "PYROSCOPE_SERVER_ADDRESS")]
    pub pyroscope_server_address: Option<String>,
    /// Also export the CPU samples as the OTLP profiles signal (alpha: its proto is
    /// `v1development` and changes between collector releases): `true` or `1` turns it on.
    #[arg(
        long,
        global = true,
        env = "RAGSCOPE_OTLP_PROFILES",
        default_value = "false",
        value_parser = parse_switch,
        action = clap::ArgAction::Set
    )]
    pub otlp_profiles: bool,
    /// OTLP/gRPC receiver of the profiles (e.g. http://otel-collector:4317); unset: the
    /// general OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4317.
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT")]
    pub otlp_profiles_endpoint: Option<String>,
    /// CPU samples per second per thread while profiling (Pyroscope and OTLP profiles alike).
    #[arg(
        long,
        global = true,
        env = "RAGSCOPE_PYROSCOPE_SAMPLE_RATE",
        default_value_t = 100,
        value_parser = blank_or::<u32>(100)
    )]
    pub pyroscope_sample_rate: u32,
    /// How often the profiler uploads what it sampled, to Pyroscope and as OTLP profiles
    /// (seconds).
    #[arg(
        long,
        global = true,
        env = "RAGSCOPE_PYROSCOPE_UPLOAD_INTERVAL",
        default_value = "10",
        value_parser = parse_seconds_or(Duration::from_secs(10))
    )]
    pub pyroscope_upload_interval: Duration,
    /// Baggage members copied onto every span of a request as `baggage.<key>` attributes
    /// (comma-separated, e.g. tenant,colour).
    #[arg(
        long,
        global = true,
        env = "RAGSCOPE_BAGGAGE_ATTRIBUTES",
        value_delimiter = ','
    )]
    pub baggage_attributes: Vec<String>,
    /// Export each pipeline stage under its own `service.name` (`ragscope-embed`, …) so trace
    /// views colour stages apart: `true` or `1` turns it on.
    #[arg(
        long,
        global = true,
        env = "RAGSCOPE_STAGE_SERVICES",
        default_value = "false",
        value_parser = parse_switch,
        action = clap::ArgAction::Set
    )]
    pub stage_services: bool,
    /// Also render other servers' metric names on `/metrics`, from the same instruments:
    /// `vllm` adds the `vllm:*` series vLLM's Grafana dashboards and benchmark clients read.
    #[arg(
        long,
        global = true,
        env = "RAGSCOPE_METRICS_COMPAT",
        value_enum,
        default_value = "none"
    )]
    pub metrics_compat: crate::compat::MetricsCompat,
    /// Bearer token of `/admin/telemetry`, which changes the trace sampling ratio, the decode
    /// step spans and content capture at run time (unset: only an admin-scope API key may).
    #[arg(
        long,
        global = true,
        env = "RAGSCOPE_TELEMETRY_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub telemetry_admin_token: Option<String>,
    /// Finished spans kept for `GET /debug/traces` (0 turns the buffer off).
    #[arg(
        long,
        global = true,
        env = "RAGSCOPE_TRACE_BUFFER",
        default_value_t = crate::buffer::DEFAULT_CAPACITY,
        value_parser = blank_or::<usize>(crate::buffer::DEFAULT_CAPACITY)
    )]
    pub trace_buffer: usize,
}

impl TelemetryArgs {
    /// The Pyroscope server to profile to, if any.
    pub fn pyroscope_server(&self) -> Option<&str> {
        [&self.pyroscope_url, &self.pyroscope_server_address]
            .into_iter()
            .flatten()
            .find(|url| !url.trim().is_empty())
            .map(String::as_str)
    }

    /// Where to export OTLP profiles, if they are on: `--otlp-profiles-endpoint`, else the
    /// general OTLP endpoint, else the gRPC default.
    pub fn otlp_profiles_target(&self) -> Option<String> {
        if !self.otlp_profiles {
            return None;
        }
        let explicit = self
            .otlp_profiles_endpoint
            .as_deref()
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_string);
        Some(
            explicit
                .or_else(|| crate::env_nonempty("OTEL_EXPORTER_OTLP_ENDPOINT"))
                .unwrap_or_else(|| "http://localhost:4317".into()),
        )
    }

    /// The baggage members to copy onto spans, trimmed, blanks dropped.
    pub fn baggage_keys(&self) -> Vec<String> {
        self.baggage_attributes
            .iter()
            .map(|key| key.trim())
            .filter(|key| !key.is_empty())
            .map(str::to_string)
            .collect()
    }
}

/// A positive number of seconds (fractions allowed).
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("{s:?} is not a positive number of seconds"))
}

// A variable set to blanks counts as unset (compose files pass empty values through), so these
// settings take their default from a blank value instead of refusing it.

/// [`parse_seconds`], with `default` for a blank value.
pub fn parse_seconds_or(default: Duration) -> impl Fn(&str) -> Result<Duration, String> + Clone {
    move |s| match s.trim() {
        "" => Ok(default),
        s => parse_seconds(s),
    }
}

/// A number, with `default` for a blank value.
pub fn blank_or<T>(default: T) -> impl Fn(&str) -> Result<T, String> + Clone
where
    T: std::str::FromStr + Clone,
    T::Err: std::fmt::Display,
{
    move |s| match s.trim() {
        "" => Ok(default.clone()),
        s => s.parse().map_err(|e| format!("{s:?}: {e}")),
    }
}

/// On for `true` or `1`, off for `false`, `0` or blank.
pub fn parse_switch(s: &str) -> Result<bool, String> {
    match s {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        s if s.trim().is_empty() => Ok(false),
        s => Err(format!("{s:?}: give true, 1, false or 0")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blank_telemetry_values_mean_the_default() {
        assert_eq!(blank_or(4096usize)(" ").unwrap(), 4096);
        assert_eq!(blank_or(4096usize)(" 0 ").unwrap(), 0);
        assert!(blank_or(4096usize)("many").is_err());
        let interval = parse_seconds_or(Duration::from_secs(10));
        assert_eq!(interval("").unwrap(), Duration::from_secs(10));
        assert!(interval("0").is_err());
        assert!(!parse_switch("").unwrap());
        assert!(!parse_switch("0").unwrap());
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        telemetry: TelemetryArgs,
    }

    fn parse(args: &[&str]) -> TelemetryArgs {
        use clap::Parser;
        Cli::parse_from(std::iter::once("ragscope").chain(args.iter().copied())).telemetry
    }

    #[test]
    fn otlp_profiles_are_off_until_switched_on() {
        let endpoint = ["--otlp-profiles-endpoint", "http://collector:4317"];
        assert_eq!(parse(&endpoint).otlp_profiles_target(), None);
        let on = parse(&[&["--otlp-profiles", "true"][..], &endpoint].concat());
        assert_eq!(
            on.otlp_profiles_target().as_deref(),
            Some("http://collector:4317")
        );
        // The old flag still sets the one sampler's rate.
        assert_eq!(
            parse(&["--pyroscope-sample-rate", "50"]).pyroscope_sample_rate,
            50
        );
    }
}
