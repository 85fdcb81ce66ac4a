//! The waterfall page and the stage-event stream behind it: the stream against the spans the
//! server recorded (stand-in stages, since it is about telemetry), the page's endpoints and
//! their refusals, and the page itself in headless Chromium against the real models, its bars
//! compared with the spans from `/debug/traces`.

use std::path::PathBuf;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use measure::sse::SseParser;
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio_tungstenite::tungstenite::Message;

use crate::fakes::FakeGenerator;
use crate::helpers::{spawn_app_with, spawn_fake_app_with, TestApp};

/// Requests may bring a fault plan, and the page links traces to a Jaeger.
const PAGE_FLAGS: [&str; 6] = [
    "--faults",
    "true",
    "--fault-header",
    "true",
    "--ui-jaeger-url",
    "http://127.0.0.1:16686",
];

/// Spans go to the server's recent-trace buffer, as when it serves.
fn record_spans() {
    opentelemetry::global::set_tracer_provider(telemetry::tracer_provider(
        opentelemetry_sdk::trace::InMemorySpanExporter::default(),
        telemetry::resource(),
    ));
}

fn new_trace_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Subscribes to `trace`'s stage events; resolves once the server said `subscribed`, to the
/// task that collects every event up to `trace_end`.
async fn watch(app: &TestApp, trace: &str) -> tokio::task::JoinHandle<Vec<(String, Value)>> {
    let response = app
        .client
        .get(app.url(&format!("/debug/stages?trace_id={trace}")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let (subscribed, ready) = oneshot::channel();
    let task = tokio::spawn(async move {
        let mut subscribed = Some(subscribed);
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        let mut body = response.bytes_stream();
        while let Some(chunk) = body.next().await {
            for e in parser.push(&chunk.unwrap()) {
                let data: Value = serde_json::from_str(&e.data).unwrap();
                assert_eq!(data["type"], e.event.as_str(), "{data}");
                if e.event == "subscribed" {
                    let _ = subscribed.take().unwrap().send(());
                    continue;
                }
                let end = e.event == "trace_end";
                events.push((e.event, data));
                if end {
                    return events;
                }
            }
        }
        events
    });
    ready.await.expect("subscribed");
    task
}

/// The spans of one trace from `/debug/traces`.
async fn spans_of(app: &TestApp, trace: &str) -> Vec<Value> {
    let (status, traces) = app.get("/debug/traces").await;
    assert_eq!(status, 200);
    traces["resourceSpans"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["scopeSpans"][0]["spans"].as_array().unwrap().clone())
        .filter(|s| s["traceId"] == trace)
        .collect()
}

fn span_ms(span: &Value) -> f64 {
    let nanos = |k: &str| span[k].as_str().unwrap().parse::<u128>().unwrap();
    (nanos("endTimeUnixNano") - nanos("startTimeUnixNano")) as f64 / 1e6
}

fn events_of<'a>(events: &'a [(String, Value)], kind: &str, span: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|(k, e)| k == kind && e["span_id"] == span)
        .map(|(_, e)| e)
        .collect()
}

/// A streamed query sent as part of `trace`, read to its end.
async fn ask_in_trace(app: &TestApp, trace: &str, fault: Option<&str>) -> String {
    let mut request = app
        .client
        .post(app.url("/v1/rag/query"))
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .json(&json!({"query": "What is the capital of Zorbia?", "stream": true, "max_tokens": 6}));
    if let Some(plan) = fault {
        request = request.header("x-ragscope-fault", plan);
    }
    let r = request.send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

#[tokio::test]
async fn the_stage_stream_carries_every_span_of_the_watched_request() {
    record_spans();
    let app = spawn_fake_app_with(
        FakeGenerator::new(6),
        &["--faults", "true", "--fault-header", "true"],
    )
    .await;
    app.ingest_fixtures().await;
    let trace = new_trace_id();
    let watcher = watch(&app, &trace).await;
    // Another request at the same time, in a trace nobody watches.
    let unwatched = new_trace_id();
    let (body, _) = tokio::join!(
        ask_in_trace(&app, &trace, Some(r#"{"retrieval": {"delay_ms": 5}}"#)),
        ask_in_trace(&app, &unwatched, None),
    );
    assert!(body.contains("event: done"), "{body}");
    let events = tokio::time::timeout(Duration::from_secs(10), watcher)
        .await
        .expect("trace_end within 10 s")
        .unwrap();
    assert!(events.iter().all(|(_, e)| e["trace_id"] == trace.as_str()));
    let (last, end) = events.last().unwrap();
    assert_eq!(last, "trace_end");
    assert_eq!(end["dropped"], 0);

    let spans = spans_of(&app, &trace).await;
    assert!(spans.len() >= 8, "{spans:#?}");
    for span in &spans {
        let id = span["spanId"].as_str().unwrap();
        let (starts, ends) = (
            events_of(&events, "span_start", id),
            events_of(&events, "span_end", id),
        );
        assert_eq!((starts.len(), ends.len()), (1, 1), "{span}");
        let (start, end) = (starts[0], ends[0]);
        let at = |e: &Value| events.iter().position(|(_, x)| x == e).unwrap();
        assert!(at(start) < at(end), "span_start comes first");
        for e in [start, end] {
            assert_eq!(e["name"], span["name"]);
            assert_eq!(e["parent_span_id"], span["parentSpanId"]);
            assert_eq!(e["start_unix_nano"], span["startTimeUnixNano"]);
        }
        assert_eq!(end["end_unix_nano"], span["endTimeUnixNano"]);
        let ms = end["duration_ms"].as_f64().unwrap();
        assert!((ms - span_ms(span)).abs() < 1e-3, "{ms} vs {span}");
        let anchored = end["end_ms"].as_f64().unwrap() - end["start_ms"].as_f64().unwrap();
        assert!((anchored - ms).abs() < 1e-3, "{end}");
    }
    let by_prefix = |prefix: &str| {
        spans
            .iter()
            .find(|s| s["name"].as_str().unwrap().starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} span"))
    };
    let decode = by_prefix("decode")["spanId"].as_str().unwrap();
    let ticks = events_of(&events, "span_event", decode);
    assert_eq!(ticks.len(), 6, "one tick per token");
    assert!(ticks.iter().all(|t| t["name"] == "token"));
    assert_eq!(
        events_of(&events, "span_end", decode)[0]["service"],
        "ragscope-generate",
        "decode is coloured by its generation stage"
    );
    let retrieval = by_prefix("retrieval")["spanId"].as_str().unwrap();
    let marked = events_of(&events, "span_update", retrieval)
        .iter()
        .any(|u| u["attributes"]["rag.fault.delay_ms"].as_f64() == Some(5.0));
    assert!(marked, "the injected delay reached the stream");
    let root = by_prefix("POST /v1/rag/query");
    assert_eq!(
        end["span_id"], root["spanId"],
        "the request span ends the trace"
    );
    assert_eq!(
        events_of(&events, "span_end", root["spanId"].as_str().unwrap())[0]["service"],
        Value::Null
    );

    // The stored trace replays as the same spans, and the summary lists it with its fault.
    let (status, stored) = app.get(&format!("/ui/traces/{trace}")).await;
    assert_eq!(status, 200, "{stored}");
    let stored_ends: Vec<&Value> = stored["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "span_end")
        .collect();
    assert_eq!(stored_ends.len(), spans.len());
    for e in stored_ends {
        let live = events_of(&events, "span_end", e["span_id"].as_str().unwrap())[0];
        assert_eq!(e, live, "stored and live agree");
    }
    let (status, recent) = app.get("/ui/traces?limit=5").await;
    assert_eq!(status, 200, "{recent}");
    let listed = recent["requests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["trace_id"] == trace.as_str())
        .expect("the watched request is listed");
    assert_eq!(listed["status"], 200);
    let faults = listed["faults"].as_array().unwrap();
    assert!(
        faults
            .iter()
            .any(|f| f.as_str().unwrap().starts_with("rag.fault.delay_ms=5")),
        "{faults:?}"
    );
    let retrieval_ms = span_ms(by_prefix("retrieval"));
    assert!((listed["stages"]["retrieval"].as_f64().unwrap() - retrieval_ms).abs() < 1e-3);
    let stats = recent["stages"].as_array().unwrap();
    assert!(stats
        .iter()
        .any(|s| s["stage"] == "decode" && s["count"] == 2));
    app.stop().await;
}

#[tokio::test]
async fn the_page_endpoints_refuse_bad_input_by_name() {
    record_spans();
    let app = spawn_fake_app_with(FakeGenerator::new(2), &[]).await;
    for (path, status, param) in [
        ("/debug/stages", 400, "trace_id"),
        ("/debug/stages?trace_id=xyz", 400, "trace_id"),
        (
            "/debug/stages?trace_id=00000000000000000000000000000000",
            400,
            "trace_id",
        ),
        (
            "/debug/stages?trace_id=4bf92f3577b34da6a3ce929d0e0e4736&follow=1",
            400,
            "follow",
        ),
        ("/ui/traces?limit=0", 400, "limit"),
        ("/ui/traces?limit=many", 400, "limit"),
        ("/ui/traces?since=1", 400, "since"),
        ("/ui/traces/nothex", 400, "trace_id"),
        (
            "/ui/traces/4bf92f3577b34da6a3ce929d0e0e4736",
            404,
            "trace_id",
        ),
    ] {
        let (got, body) = app.get(path).await;
        assert_eq!(got, status, "{path}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!("{param}: ")),
            "{path}: {message}"
        );
    }
    let (status, _) = app.get("/health").await;
    assert_eq!(status, 200, "still serving");
    let metrics = app.client.get(app.url("/metrics")).send().await.unwrap();
    let metrics = metrics.text().await.unwrap();
    assert!(
        metrics.contains("ragscope_stage_events_dropped_total"),
        "{metrics}"
    );
    app.stop().await;
}

#[tokio::test]
async fn the_page_its_assets_and_its_colours_are_served() {
    let mut flags = PAGE_FLAGS.to_vec();
    flags.extend(["--ui-pyroscope-url", "http://127.0.0.1:4040/x?s={span_id}"]);
    let app = spawn_fake_app_with(FakeGenerator::new(2), &flags).await;
    let mut total = 0;
    for (path, kind) in [
        ("/", "text/html"),
        ("/ui", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/style.css", "text/css"),
    ] {
        let r = app.client.get(app.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let content_type = r.headers()["content-type"].to_str().unwrap().to_string();
        assert!(content_type.starts_with(kind), "{path}: {content_type}");
        let body = r.text().await.unwrap();
        for external in [
            "src=\"http",
            "href=\"http",
            "url(http",
            "@import",
            "import(",
        ] {
            assert!(
                !body.contains(external),
                "{path} loads something from elsewhere"
            );
        }
        total += body.len();
    }
    assert!(total < 1 << 20, "the page is {total} bytes");
    let (status, config) = app.get("/ui/config").await;
    assert_eq!(status, 200);
    for service in telemetry::names::stage_services() {
        assert!(
            config["colours"][service].is_string(),
            "{service}: {config}"
        );
    }
    assert_eq!(config["fault_header"], true);
    assert_eq!(
        config["links"]["jaeger"],
        "http://127.0.0.1:16686/trace/{trace_id}"
    );
    assert_eq!(
        config["links"]["pyroscope"],
        "http://127.0.0.1:4040/x?s={span_id}"
    );
    assert_eq!(config["links"]["tempo"], Value::Null);
    app.stop().await;
}

// ------------------------------------------------------------------ the page in Chromium

/// Chromium from `RAGSCOPE_CHROMIUM` or the PATH (Debian's package installs `chromium`).
fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("RAGSCOPE_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find_map(|dir| {
        ["chromium", "chromium-browser", "google-chrome"]
            .iter()
            .map(|name| dir.join(name))
            .find(|p| p.is_file())
    })
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Headless Chromium driven over the DevTools protocol: one page target, commands by id.
struct Browser {
    _process: tokio::process::Child,
    _profile: tempfile::TempDir,
    socket: Socket,
    next_id: u64,
}

impl Browser {
    async fn launch(exe: &std::path::Path) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let mut command = tokio::process::Command::new(exe);
        command
            .args([
                "--headless=new",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-extensions",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--window-size=1440,1000",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true);
        // Chromium's sandbox refuses to run as root (CI containers).
        if unsafe { libc::geteuid() } == 0 {
            command.arg("--no-sandbox");
        }
        let process = command.spawn().expect("chromium starts");
        let port_file = profile.path().join("DevToolsActivePort");
        let port = loop {
            if let Ok(text) = std::fs::read_to_string(&port_file) {
                if let Some(port) = text
                    .lines()
                    .next()
                    .and_then(|l| l.trim().parse::<u16>().ok())
                {
                    break port;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let targets: Value = reqwest::get(format!("http://127.0.0.1:{port}/json/list"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let url = targets
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            .expect("a page target")
            .to_string();
        let (socket, _) = tokio_tungstenite::connect_async(url).await.unwrap();
        Browser {
            _process: process,
            _profile: profile,
            socket,
            next_id: 0,
        }
    }

    /// Sends a command and waits for its result (events in between are skipped).
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let command = json!({"id": id, "method": method, "params": params}).to_string();
        self.socket.send(Message::text(command)).await.unwrap();
        while let Some(message) = self.socket.next().await {
            let Message::Text(text) = message.unwrap() else {
                continue;
            };
            let reply: Value = serde_json::from_str(&text).unwrap();
            if reply["id"] == id {
                assert!(reply["error"].is_null(), "{method}: {reply}");
                return reply["result"].clone();
            }
        }
        panic!("the browser closed the connection during {method}");
    }

    /// Evaluates `expression` in the page (awaiting a promise) and returns its value.
    async fn eval(&mut self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "awaitPromise": true, "returnByValue": true}),
            )
            .await;
        assert!(
            result["exceptionDetails"].is_null(),
            "{expression}: {}",
            result["exceptionDetails"]
        );
        result["result"]["value"].clone()
    }

    /// Waits until `condition` (a JS expression) holds in the page.
    async fn until(&mut self, condition: &str) {
        let poll = format!(
            "new Promise((resolve) => {{ const t = setInterval(() => {{ if ({condition}) {{ clearInterval(t); resolve(true); }} }}, 25); }})"
        );
        self.eval(&poll).await;
    }
}

const READ_BARS: &str = r##"(() => {
  const svg = document.getElementById("waterfall");
  const bars = [...svg.querySelectorAll("rect.bar")].map((r) => ({
    span_id: r.dataset.spanId, name: r.dataset.name, stage: r.dataset.stage,
    service: r.dataset.service, duration_ms: Number(r.dataset.durationMs),
    width: Number(r.getAttribute("width")), fill: r.getAttribute("fill"),
    fault: r.dataset.fault, open: r.dataset.open,
    ticks: r.parentNode.querySelectorAll("line.tick").length,
  }));
  return { trace_id: svg.dataset.traceId, px_per_ms: Number(svg.dataset.pxPerMs),
    open_frames: Number(svg.dataset.openFrames || 0), bars,
    answer: document.getElementById("answer").textContent,
    sources: document.querySelectorAll("#sources li").length,
    outcome: document.body.dataset.outcome,
    foot: document.getElementById("wf-foot").textContent,
    jaeger: (document.querySelector("#wf-links a") || {}).href || null };
})()"##;

/// Each bar against the recorded span of the same id: as many bars as spans, durations and
/// widths within 2%, colours from the server's map.
fn check_bars(page: &Value, spans: &[Value], config: &Value) {
    let bars = page["bars"].as_array().unwrap();
    assert_eq!(bars.len(), spans.len(), "one bar per span: {page:#}");
    let px = page["px_per_ms"].as_f64().unwrap();
    assert!(px > 0.0);
    for span in spans {
        let ms = span_ms(span);
        let bar = bars
            .iter()
            .find(|b| b["span_id"] == span["spanId"])
            .unwrap_or_else(|| panic!("no bar for {span}"));
        let tolerance = 0.02 * ms + 1e-3;
        let drawn = bar["duration_ms"].as_f64().unwrap();
        assert!((drawn - ms).abs() <= tolerance, "{bar} vs {ms} ms");
        let wide = bar["width"].as_f64().unwrap() / px;
        assert!(
            (wide - ms).abs() <= tolerance,
            "{bar}: {wide} ms wide vs {ms} ms"
        );
        assert_eq!(bar["open"], "false", "{bar}");
        let service = bar["service"].as_str().unwrap();
        let colour = if service.is_empty() {
            &config["other_colour"]
        } else {
            &config["colours"][service]
        };
        assert_eq!(&bar["fill"], colour, "{bar}");
    }
}

#[tokio::test]
async fn the_page_draws_a_live_waterfall_that_matches_the_recorded_spans() {
    let Some(exe) = chromium() else {
        assert!(
            std::env::var_os("RAGSCOPE_REQUIRE_CHROMIUM").is_none(),
            "RAGSCOPE_REQUIRE_CHROMIUM is set but no chromium was found (apt-get install chromium)"
        );
        eprintln!(
            "skipped: no chromium on PATH (apt-get install chromium, or set RAGSCOPE_CHROMIUM)"
        );
        return;
    };
    record_spans();
    let app = spawn_app_with(&PAGE_FLAGS).await;
    app.ingest_fixtures().await;
    let (_, config) = app.get("/ui/config").await;

    tokio::time::timeout(Duration::from_secs(60), async {
        let mut browser = Browser::launch(&exe).await;
        browser
            .call(
                "Emulation.setDeviceMetricsOverride",
                json!({"width": 1440, "height": 1000, "deviceScaleFactor": 1, "mobile": false}),
            )
            .await;
        browser
            .call("Page.navigate", json!({"url": app.url("/")}))
            .await;
        browser
            .until("document.body && document.body.dataset.ready === 'true'")
            .await;
        browser
            .eval(
                r#"(() => {
                  document.getElementById("question").value = "What is the capital of Zorbia?";
                  document.getElementById("max-tokens").value = "24";
                  document.getElementById("fault").value = '{"retrieval": {"delay_ms": 40}}';
                  document.getElementById("ask").requestSubmit();
                  return true;
                })()"#,
            )
            .await;
        browser.until("document.body.dataset.state === 'done'").await;
        let live = browser.eval(READ_BARS).await;
        assert_eq!(live["outcome"], "ok", "{live:#}");
        let trace = live["trace_id"].as_str().unwrap().to_string();
        assert!(live["foot"].as_str().unwrap().contains("live"), "{live:#}");
        assert!(!live["answer"].as_str().unwrap().trim().is_empty());
        assert!(live["sources"].as_u64().unwrap() > 0);
        assert!(live["open_frames"].as_u64().unwrap() > 0, "bars grew while spans ran");
        assert_eq!(
            live["jaeger"],
            format!("http://127.0.0.1:16686/trace/{trace}").as_str()
        );

        let spans = spans_of(&app, &trace).await;
        check_bars(&live, &spans, &config);
        let bar = |stage: &str| {
            live["bars"]
                .as_array()
                .unwrap()
                .iter()
                .find(|b| b["stage"] == stage)
                .unwrap_or_else(|| panic!("no {stage} bar"))
                .clone()
        };
        assert!(bar("retrieval")["fault"]
            .as_str()
            .unwrap()
            .contains("rag.fault.delay_ms=40"));
        let decode = spans
            .iter()
            .find(|s| s["name"] == "decode")
            .expect("a decode span");
        let tokens = decode["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "token")
            .count();
        assert!(tokens > 0);
        assert_eq!(bar("decode")["ticks"], tokens, "one tick per token");

        let size = browser.call("Page.getLayoutMetrics", json!({})).await["cssContentSize"].clone();
        let clip = json!({"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1});
        let png = browser
            .call(
                "Page.captureScreenshot",
                json!({"format": "png", "captureBeyondViewport": true, "clip": clip}),
            )
            .await;
        let png = base64::Engine::decode(
            &base64::engine::general_purpose::STANDARD,
            png["data"].as_str().unwrap(),
        )
        .unwrap();
        assert!(png.starts_with(b"\x89PNG"));
        let mut dirs = vec![PathBuf::from(env!("CARGO_TARGET_TMPDIR"))];
        dirs.extend(std::env::var_os("RAGSCOPE_SCREENSHOT_DIR").map(PathBuf::from));
        for dir in dirs {
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("waterfall.png");
            std::fs::write(&path, &png).unwrap();
            eprintln!("screenshot: {}", path.display());
        }

        // The recent table lists the request; its row opens the stored waterfall.
        browser
            .until(&format!(
                "document.querySelector('#recent tbody tr[data-trace-id=\"{trace}\"]')"
            ))
            .await;
        browser
            .eval(&format!(
                "document.querySelector('#recent tbody tr[data-trace-id=\"{trace}\"]').click(), true"
            ))
            .await;
        browser
            .until("document.getElementById('wf-foot').textContent.includes('trace buffer')")
            .await;
        let stored = browser.eval(READ_BARS).await;
        assert_eq!(stored["trace_id"], trace.as_str());
        check_bars(&stored, &spans, &config);
    })
    .await
    .expect("the browser test finishes within 60 s");
    app.stop().await;
}
