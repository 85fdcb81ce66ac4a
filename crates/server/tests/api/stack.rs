//! The compose stack's configuration, checked with real parsers since no Docker engine runs
//! here: every datasource uid used is provisioned; the collector's pipelines reference only
//! components it defines and use every one; `promtool` accepts the Prometheus files;
//! `docker-compose config` accepts the compose file and profiles. (That every metric a panel or
//! rule queries is one the server serves is `promql.rs`.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};

pub(crate) fn repo() -> PathBuf {
    crate::helpers::repo_dir()
}

pub(crate) fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// The file as JSON, with YAML merge keys (`<<: *anchor`) applied as compose applies them.
pub(crate) fn yaml(rel: &str) -> Value {
    let mut doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&read(rel))
        .unwrap_or_else(|e| panic!("{rel} is not valid YAML: {e}"));
    doc.apply_merge()
        .unwrap_or_else(|e| panic!("{rel}: merge keys: {e}"));
    serde_yaml_ng::from_value(doc).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

pub(crate) fn json_file(rel: &str) -> Value {
    serde_json::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel} is not valid JSON: {e}"))
}

pub(crate) const DASHBOARDS: &[&str] = &[
    "grafana/dashboards/rag-stage-latency.json",
    "grafana/dashboards/trace-to-profile.json",
];
pub(crate) const DATASOURCES: &str = "grafana/provisioning/datasources/datasources.yaml";
pub(crate) const COLLECTOR: &str = "otel-collector.yaml";
pub(crate) const PROMETHEUS: &str = "prometheus/prometheus.yml";
pub(crate) const RULES: &str = "prometheus/rules.yml";
pub(crate) const COMPOSE: &str = "docker-compose.yml";

/// Every object under `v` that has `key` (with the path to it).
fn find_key<'a>(v: &'a Value, key: &str, path: String, out: &mut Vec<(String, &'a Value)>) {
    match v {
        Value::Object(map) => {
            for (k, child) in map {
                let p = format!("{path}/{k}");
                if k == key {
                    out.push((p.clone(), child));
                }
                find_key(child, key, p, out);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                find_key(child, key, format!("{path}/{i}"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn every_datasource_uid_used_is_provisioned() {
    let ds = yaml(DATASOURCES);
    let provisioned: BTreeMap<String, String> = ds["datasources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["uid"]
                    .as_str()
                    .expect("every datasource has a uid")
                    .to_string(),
                d["type"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for (uid, kind) in [
        ("prometheus", "prometheus"),
        ("tempo", "tempo"),
        ("jaeger", "jaeger"),
        ("pyroscope", "grafana-pyroscope-datasource"),
    ] {
        assert_eq!(
            provisioned.get(uid).map(String::as_str),
            Some(kind),
            "{uid}"
        );
    }

    // Links between datasources.
    let mut links = Vec::new();
    find_key(&ds, "datasourceUid", String::new(), &mut links);
    assert!(links.len() >= 5, "{links:?}");
    for (path, uid) in &links {
        let uid = uid.as_str().unwrap();
        assert!(
            provisioned.contains_key(uid),
            "{DATASOURCES}{path}: {uid} is not provisioned"
        );
    }
    let tempo = ds["datasources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["uid"] == "tempo")
        .unwrap();
    let to_profiles = &tempo["jsonData"]["tracesToProfiles"];
    assert_eq!(to_profiles["datasourceUid"], "pyroscope");
    assert_eq!(
        to_profiles["profileTypeId"],
        "process_cpu:cpu:nanoseconds:cpu:nanoseconds"
    );
    assert_eq!(
        tempo["jsonData"]["serviceMap"]["datasourceUid"],
        "prometheus"
    );
    let prom = ds["datasources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["uid"] == "prometheus")
        .unwrap();
    assert_eq!(
        prom["jsonData"]["exemplarTraceIdDestinations"][0]["datasourceUid"],
        "tempo"
    );

    // Dashboards: every datasource reference names a provisioned uid of the right type.
    let mut titles = BTreeSet::new();
    for file in DASHBOARDS {
        let dash = json_file(file);
        titles.insert(dash["title"].as_str().unwrap().to_string());
        let mut refs = Vec::new();
        find_key(&dash, "datasource", String::new(), &mut refs);
        assert!(!refs.is_empty(), "{file} uses no datasource");
        for (path, r) in refs {
            let uid = r["uid"]
                .as_str()
                .unwrap_or_else(|| panic!("{file}{path}: datasource without a uid: {r}"));
            let kind = provisioned
                .get(uid)
                .unwrap_or_else(|| panic!("{file}{path}: datasource uid {uid} is not provisioned"));
            if let Some(t) = r["type"].as_str() {
                assert_eq!(t, kind, "{file}{path}: uid {uid} is a {kind}, not a {t}");
            }
        }
        // Unique panel ids, and every non-row, non-text panel queries something.
        let mut ids = BTreeSet::new();
        for p in dash["panels"].as_array().unwrap() {
            assert!(
                ids.insert(p["id"].as_u64().unwrap()),
                "{file}: duplicate panel id"
            );
            let kind = p["type"].as_str().unwrap();
            if kind != "row" && kind != "text" {
                assert!(
                    p["targets"].as_array().is_some_and(|t| !t.is_empty()),
                    "{file}: panel {} has no query",
                    p["title"]
                );
            }
        }
    }
    assert_eq!(
        titles,
        BTreeSet::from([
            "RAG stage latency".to_string(),
            "Trace to profile".to_string()
        ])
    );

    // The dashboard provider points where compose mounts the dashboards.
    let providers = yaml("grafana/provisioning/dashboards/dashboards.yaml");
    let path = providers["providers"][0]["options"]["path"]
        .as_str()
        .unwrap();
    assert!(
        read(COMPOSE).contains(&format!("./grafana/dashboards:{path}:ro")),
        "compose does not mount grafana/dashboards at {path}"
    );
}

// ---------- the collector's pipelines ----------

/// Problems in a collector config: references to undefined components, defined components
/// no pipeline uses, connectors not used on both sides.
fn collector_problems(cfg: &Value) -> Vec<String> {
    let defined = |section: &str| -> BTreeSet<String> {
        cfg[section]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    };
    let receivers = defined("receivers");
    let processors = defined("processors");
    let exporters = defined("exporters");
    let connectors = defined("connectors");
    let extensions = defined("extensions");
    let list = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    let mut problems = Vec::new();
    let (mut used_r, mut used_p, mut used_e) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    let (mut conn_in, mut conn_out) = (BTreeSet::new(), BTreeSet::new());
    let pipelines = cfg["service"]["pipelines"].as_object();
    if pipelines.is_none_or(|p| p.is_empty()) {
        problems.push("no pipelines".into());
    }
    for (name, p) in pipelines.into_iter().flatten() {
        let kind = name.split('/').next().unwrap();
        if !["traces", "metrics", "logs", "profiles"].contains(&kind) {
            problems.push(format!("pipeline {name}: unknown signal {kind}"));
        }
        let rs = list(&p["receivers"]);
        let es = list(&p["exporters"]);
        if rs.is_empty() || es.is_empty() {
            problems.push(format!("pipeline {name}: needs receivers and exporters"));
        }
        for r in rs {
            if connectors.contains(&r) {
                conn_out.insert(r.clone());
            } else if !receivers.contains(&r) {
                problems.push(format!("pipeline {name}: receiver {r} is not defined"));
            }
            used_r.insert(r);
        }
        for x in list(&p["processors"]) {
            if !processors.contains(&x) {
                problems.push(format!("pipeline {name}: processor {x} is not defined"));
            }
            used_p.insert(x);
        }
        for e in es {
            if connectors.contains(&e) {
                conn_in.insert(e.clone());
            } else if !exporters.contains(&e) {
                problems.push(format!("pipeline {name}: exporter {e} is not defined"));
            }
            used_e.insert(e);
        }
    }
    for x in list(&cfg["service"]["extensions"]) {
        if !extensions.contains(&x) {
            problems.push(format!("extension {x} is not defined"));
        }
    }
    let used_x: BTreeSet<String> = list(&cfg["service"]["extensions"]).into_iter().collect();
    for (section, all, used) in [
        ("receiver", &receivers, &used_r),
        ("processor", &processors, &used_p),
        ("exporter", &exporters, &used_e),
        ("extension", &extensions, &used_x),
    ] {
        for c in all.difference(used) {
            problems.push(format!("{section} {c} is defined but no pipeline uses it"));
        }
    }
    for c in &connectors {
        if !conn_in.contains(c) || !conn_out.contains(c) {
            problems.push(format!(
                "connector {c} must be an exporter of one pipeline and a receiver of another"
            ));
        }
    }
    problems
}

#[test]
fn collector_pipelines_reference_only_defined_components_and_use_them_all() {
    let cfg = yaml(COLLECTOR);
    let problems = collector_problems(&cfg);
    assert!(problems.is_empty(), "{COLLECTOR}:\n{}", problems.join("\n"));
    // What the stack relies on.
    let traces = &cfg["service"]["pipelines"]["traces"]["exporters"];
    for e in ["otlp/jaeger", "otlp/tempo", "spanmetrics"] {
        assert!(
            traces.as_array().unwrap().contains(&json!(e)),
            "traces → {e}"
        );
    }
    assert_eq!(
        cfg["connectors"]["spanmetrics"]["exemplars"]["enabled"],
        true
    );
    assert_eq!(cfg["exporters"]["prometheus"]["enable_open_metrics"], true);
    assert_eq!(
        cfg["service"]["pipelines"]["traces"]["processors"][0], "memory_limiter",
        "memory_limiter must come first"
    );

    // The checker itself catches the mistakes it is for.
    let mut broken = cfg.clone();
    broken["service"]["pipelines"]["traces"]["exporters"] = json!(["otlp/jeager", "spanmetrics"]);
    let p = collector_problems(&broken);
    assert!(
        p.iter().any(|x| x.contains("otlp/jeager is not defined")),
        "{p:?}"
    );
    assert!(
        p.iter().any(|x| x.contains("otlp/tempo is defined but")),
        "{p:?}"
    );
    let mut broken = cfg.clone();
    broken["service"]["pipelines"]
        .as_object_mut()
        .unwrap()
        .remove("metrics/spanmetrics");
    let p = collector_problems(&broken);
    assert!(
        p.iter().any(|x| x.starts_with("connector spanmetrics")),
        "{p:?}"
    );
}

// ---------- Prometheus ----------

#[test]
fn prometheus_config_and_rules_pass_promtool() {
    let Some(promtool) = crate::metrics::promtool() else {
        assert!(
            std::env::var_os("RAGSCOPE_REQUIRE_PROMTOOL").is_none(),
            "promtool not found"
        );
        println!(
            "SKIPPED promtool check config/rules: promtool not installed (scripts/test unpacks it)"
        );
        return;
    };
    for args in [["check", "config", PROMETHEUS], ["check", "rules", RULES]] {
        let out = Command::new(&promtool)
            .args(args)
            .current_dir(repo())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The alert rules' own unit tests: synthetic series, when each alert fires and when not.
    let out = Command::new(&promtool)
        .args(["test", "rules", "rules.test.yml"])
        .current_dir(repo().join("prometheus"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool test rules failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Compose mounts the rule files where the config expects them.
    let cfg = yaml(PROMETHEUS);
    let compose = read(COMPOSE);
    for f in cfg["rule_files"].as_array().unwrap() {
        let f = f.as_str().unwrap();
        assert!(
            compose.contains(&format!("./prometheus/{f}:/etc/prometheus/{f}:ro")),
            "compose does not mount prometheus/{f}"
        );
    }
}

// ---------- docker compose ----------

/// `${VAR:-default}` → `default`, `${VAR}` → ``.
fn with_defaults(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').map(|e| start + e).unwrap();
        let inner = &rest[start + 2..end];
        if let Some((_, default)) = inner.split_once(":-") {
            out.push_str(default);
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

#[test]
fn compose_services_are_pinned_and_their_files_and_ports_documented() {
    let compose = yaml(COMPOSE);
    let readme = read("README.md");
    let section = readme
        .split("## The full stack (docker compose)")
        .nth(1)
        .expect("README has the full-stack section")
        .split("\n## ")
        .next()
        .unwrap()
        .to_string();
    let header: String = read(COMPOSE)
        .lines()
        .take_while(|l| l.starts_with('#') || l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    let services = compose["services"].as_object().unwrap();
    for name in [
        "ragscope",
        "qdrant",
        "otel-collector",
        "jaeger",
        "tempo",
        "pyroscope",
        "prometheus",
        "grafana",
        "loadgen",
    ] {
        assert!(services.contains_key(name), "service {name} missing");
    }
    let mut published = BTreeSet::new();
    for (name, svc) in services {
        if let Some(image) = svc["image"].as_str() {
            let image = with_defaults(image);
            let tag = image.rsplit_once(':').map(|(_, t)| t);
            assert!(
                tag.is_some_and(|t| !t.is_empty() && t != "latest" && !t.contains('/')),
                "{name}: image {image} is not pinned to a tag"
            );
        }
        for v in svc["volumes"].as_array().into_iter().flatten() {
            let v = v.as_str().unwrap();
            if let Some(rel) = v.strip_prefix("./") {
                let host = rel.split(':').next().unwrap();
                assert!(
                    repo().join(host).exists(),
                    "{name}: mounts ./{host}, which does not exist"
                );
            }
        }
        for p in svc["ports"].as_array().into_iter().flatten() {
            let p = with_defaults(p.as_str().unwrap());
            let host = p.rsplit_once(':').unwrap().0;
            let host = host.rsplit(':').next().unwrap();
            published.insert(host.to_string());
        }
    }
    assert!(published.len() >= 10, "{published:?}");
    for port in &published {
        assert!(
            header.contains(&format!("#   {port} ")),
            "port {port} is not documented in the comment at the top of {COMPOSE}"
        );
        assert!(
            section.contains(&format!("| {port} |")),
            "port {port} is not in the README's ports table"
        );
    }
    // The replicas publish nothing, so `--scale ragscope=N` never clashes on a host port.
    assert!(
        services["ragscope"]["ports"].is_null(),
        "ragscope must not publish host ports"
    );
    // The light profile is server + Qdrant + Jaeger.
    let light = &services["ragscope-light"];
    assert_eq!(light["profiles"], json!(["light"]));
    let deps: BTreeSet<&str> = light["depends_on"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(deps, BTreeSet::from(["qdrant", "jaeger"]));
    assert_eq!(services["loadgen"]["profiles"], json!(["loadgen"]));
    // The cluster profile: two replicas behind their own gateway on three Qdrant peers, with
    // the layout that survives one peer (3 shards x 2 copies), publishing nothing but the
    // gateway's ports.
    let cluster = [
        "ragscope-cluster",
        "gateway-cluster",
        "qdrant-0",
        "qdrant-1",
        "qdrant-2",
    ];
    for name in cluster {
        assert_eq!(services[name]["profiles"], json!(["cluster"]), "{name}");
    }
    let replicas = &services["ragscope-cluster"];
    assert_eq!(replicas["deploy"]["replicas"], json!(2));
    assert!(
        replicas["ports"].is_null(),
        "cluster replicas publish nothing"
    );
    let env = &replicas["environment"];
    assert_eq!(env["RAGSCOPE_QDRANT_SHARDS"], json!(3));
    assert_eq!(env["RAGSCOPE_QDRANT_REPLICATION_FACTOR"], json!(2));
    for peer in ["qdrant-1", "qdrant-2"] {
        let command = services[peer]["command"].as_array().unwrap();
        assert!(
            command.contains(&json!("--bootstrap")),
            "{peer} joins the cluster"
        );
    }
    // Plain `docker compose up` is the full stack: only the light server, loadgen and the
    // cluster profile are gated.
    for (name, svc) in services {
        if !svc["profiles"].is_null() {
            assert!(
                ["ragscope-light", "loadgen"].contains(&name.as_str())
                    || cluster.contains(&name.as_str()),
                "{name} has a profile"
            );
        }
    }
}

/// `docker-compose` (Debian's 1.29) or `docker compose`, whichever exists.
fn compose_command() -> Option<Vec<String>> {
    if Command::new("docker-compose")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Some(vec!["docker-compose".into()]);
    }
    if Command::new("docker")
        .args(["compose", "version"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Some(vec!["docker".into(), "compose".into()]);
    }
    None
}

#[test]
fn compose_file_passes_docker_compose_config() {
    let Some(cmd) = compose_command() else {
        assert!(
            std::env::var_os("RAGSCOPE_REQUIRE_COMPOSE").is_none(),
            "docker-compose not found (RAGSCOPE_REQUIRE_COMPOSE is set)"
        );
        println!("SKIPPED docker-compose config: neither docker-compose nor docker compose is installed (scripts/test installs Debian's docker-compose)");
        return;
    };
    for profiles in [&[][..], &["light"], &["loadgen"], &["cluster"]] {
        let mut c = Command::new(&cmd[0]);
        c.args(&cmd[1..]).args(["-f", COMPOSE]);
        for p in profiles {
            c.args(["--profile", p]);
        }
        let out = c
            .args(["config", "-q"])
            .current_dir(repo())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{cmd:?} config with profiles {profiles:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
