//! Fuzzing the HTTP surface: proptest generates request bodies (valid shapes with fields
//! replaced by wrong types, huge strings and numbers, nested values, removed or unknown fields),
//! bytes that are not UTF-8, bodies nested 10,000 deep, and random methods, paths and content
//! types, and sends them to the real router and handlers in-process (stand-in model stages: the
//! models are not what is under test). Every answer must be below 500 and every 4xx the JSON
//! error shape with the field at fault first in its message; the server must still answer
//! `/health` after. The cases are drawn from a fixed seed (`RAGSCOPE_FUZZ_SEED` picks another)
//! and sent concurrently; a failure prints the request that caused it.

use futures::StreamExt;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::{json, Value};

use crate::fakes::FakeGenerator;
use crate::helpers::{spawn_fake_app, TestApp};
use crate::openapi::{fetch_document, validate};

/// A request as sent, printed when its answer breaks a rule.
#[derive(Debug, Clone)]
struct Case {
    method: String,
    path: String,
    content_type: Option<String>,
    body: Vec<u8>,
}

impl Case {
    fn json(method: &str, path: &str, body: &Value) -> Case {
        Case {
            method: method.into(),
            path: path.into(),
            content_type: Some("application/json".into()),
            body: serde_json::to_vec(body).unwrap(),
        }
    }

    fn describe(&self) -> String {
        let body = String::from_utf8_lossy(&self.body);
        let shown: String = body.chars().take(300).collect();
        format!(
            "{} {} (content-type {:?}, {} bytes: {shown})",
            self.method,
            self.path.chars().take(200).collect::<String>(),
            self.content_type,
            self.body.len()
        )
    }
}

/// A valid body for each JSON endpoint, the shapes the mutations start from.
fn seeds() -> Vec<(&'static str, &'static str, Value)> {
    vec![
        (
            "POST",
            "/v1/rag/query",
            json!({"query": "What is the capital of Zorbia?", "top_k": 2,
            "rerank_top_n": 1, "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "seed": 7,
            "filter": {"doc_id": "zorbia"}, "stream": false, "stop": ["."], "logprobs": 1,
            "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1,
            "no_repeat_ngram_size": 3, "penalize_prompt": false, "copy_bias": 2.0,
            "end_at_paragraph": false, "context": "sentences",
            "context_budget": 64, "context_method": "lexical"}),
        ),
        (
            "POST",
            "/v1/chat/completions",
            json!({"model": "ragscope",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi?"}]}],
            "max_tokens": 2, "max_completion_tokens": 2, "temperature": 0.7, "top_p": 0.9, "seed": 1,
            "stream": false, "stop": "x", "n": 2, "logprobs": true, "top_logprobs": 1,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_k": 2, "filter": {"source": {"any": ["a"]}},
            "user": "u", "metadata": {"k": "v"}, "store": false, "stream_options": {"include_usage": true},
            "tools": [], "response_format": {"type": "text"}}),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"model": "fake-generator-plain", "prompt": ["a b c", "d e"],
            "max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": 3, "n": 2, "echo": true,
            "stream": false, "user": "u", "best_of": 1}),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"model": "fake-generator-plain", "prompt": [[1, 2, 3]], "max_tokens": 0,
            "logprobs": 1, "echo": true}),
        ),
        (
            "POST",
            "/v1/embeddings",
            json!({"model": "fake-embedder", "input": ["a", "b"],
            "encoding_format": "base64", "dimensions": 4, "user": "u"}),
        ),
        (
            "POST",
            "/v1/rerank",
            json!({"query": "tool", "documents": ["a flumox", "an island"],
            "top_n": 1, "return_documents": true}),
        ),
        (
            "POST",
            "/v1/documents",
            json!({"documents": [{"id": "d1", "text": "# T\n\nSome text here.",
            "source": "s.md", "format": "markdown", "metadata": {"topic": "x", "year": 2024}}]}),
        ),
        (
            "POST",
            "/tokenize",
            json!({"content": "a b c", "add_special": false, "parse_special": true,
            "with_pieces": true}),
        ),
        (
            "POST",
            "/tokenize",
            json!({"model": "fake-generator", "messages": [{"role": "user", "content": "a b"}],
            "add_generation_prompt": true, "return_token_strs": true}),
        ),
        (
            "POST",
            "/detokenize",
            json!({"tokens": [1, 2, 3], "model": "fake-generator"}),
        ),
    ]
}

/// A JSON value of any kind, including the extremes.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop_oneof![
            Just(-1.0),
            Just(1e308),
            Just(-1e308),
            Just(0.5),
            Just(5e-324)
        ]
        .prop_map(Value::from),
        ".{0,24}".prop_map(Value::from),
        "[\\x00-\\x1f\u{202e}\u{fffd}\u{10ffff}]{0,8}".prop_map(Value::from),
        (0usize..200_000).prop_map(|n| Value::from("y".repeat(n))),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// What a mutation does to the field it picks.
#[derive(Debug, Clone)]
enum Change {
    Replace(Value),
    Remove,
    AddUnknown(String, Value),
}

fn any_change() -> impl Strategy<Value = Change> {
    prop_oneof![
        6 => any_json().prop_map(Change::Replace),
        2 => Just(Change::Remove),
        1 => ("[a-z_]{1,16}", any_json()).prop_map(|(k, v)| Change::AddUnknown(k, v)),
    ]
}

/// Applies `changes` to `body`, each at a field picked by its number; `descend` steps into
/// an object or array field first, so nested fields (`messages[0].content`) get changed too.
fn mutate(body: &mut Value, picks: &[(usize, bool, Change)]) {
    for (pick, descend, change) in picks {
        let mut target = &mut *body;
        if *descend {
            let child = match &*target {
                Value::Object(m) if !m.is_empty() => {
                    Some(m.keys().nth(pick % m.len()).unwrap().clone())
                }
                _ => None,
            };
            if let Some(k) = child {
                let index = match &target[k.as_str()] {
                    Value::Array(a) if !a.is_empty() => Some(pick % a.len()),
                    _ => None,
                };
                let inner = &mut target[k.as_str()];
                target = match index {
                    Some(i) => &mut inner[i],
                    None => inner,
                };
            }
        }
        let Value::Object(m) = target else {
            *target = match change {
                Change::Replace(v) | Change::AddUnknown(_, v) => v.clone(),
                Change::Remove => Value::Null,
            };
            continue;
        };
        let key = (!m.is_empty()).then(|| m.keys().nth(pick % m.len()).unwrap().clone());
        match (change, key) {
            (Change::Replace(v), Some(k)) => {
                m.insert(k, v.clone());
            }
            (Change::Remove, Some(k)) => {
                m.remove(&k);
            }
            (Change::AddUnknown(k, v), _) => {
                m.insert(format!("zz_{k}"), v.clone());
            }
            (Change::Replace(v), None) => {
                m.insert("zz_field".into(), v.clone());
            }
            (Change::Remove, None) => {}
        }
    }
}

/// Draws `n` values of `strategy` from the runner's generator.
fn draw<S: Strategy>(runner: &mut TestRunner, strategy: S, n: usize) -> Vec<S::Value> {
    (0..n)
        .map(|_| strategy.new_tree(runner).expect("a value").current())
        .collect()
}

fn runner() -> TestRunner {
    let seed: u64 = std::env::var("RAGSCOPE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1516);
    println!("fuzz seed {seed} (RAGSCOPE_FUZZ_SEED picks another)");
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    )
}

/// Bodies that mutate the seeds: wrong types, extremes, missing and unknown fields.
fn body_cases(runner: &mut TestRunner, n: usize) -> Vec<Case> {
    let seeds = seeds();
    let picks = prop::collection::vec((any::<usize>(), any::<bool>(), any_change()), 1..4);
    draw(runner, (0..seeds.len(), picks, any::<bool>()), n)
        .into_iter()
        .map(|(i, picks, stream)| {
            let (method, path, mut body) = seeds[i].clone();
            if stream && body.get("stream").is_some() {
                body["stream"] = json!(true);
            }
            mutate(&mut body, &picks);
            Case::json(method, path, &body)
        })
        .collect()
}

/// Bytes that are not JSON, or JSON whose strings hold bytes that are not UTF-8.
fn byte_cases(runner: &mut TestRunner, n: usize) -> Vec<Case> {
    let seeds = seeds();
    let bytes = prop::collection::vec(any::<u8>(), 0..2048);
    draw(
        runner,
        (0..seeds.len(), bytes, any::<usize>(), any::<bool>()),
        n,
    )
    .into_iter()
    .map(|(i, random, at, inject)| {
        let (method, path, body) = &seeds[i];
        let body = if inject {
            // A seed's text with a byte that no UTF-8 text holds, inside a string.
            let mut b = serde_json::to_vec(body).unwrap();
            let quotes: Vec<usize> = (0..b.len()).filter(|&j| b[j] == b'"').collect();
            let q = quotes[at % quotes.len()] + 1;
            b.splice(q..q, [0xff, 0xc3, 0x28]);
            b
        } else {
            random
        };
        Case {
            method: method.to_string(),
            path: path.to_string(),
            content_type: Some("application/json".into()),
            body,
        }
    })
    .collect()
}

/// Random methods, paths (documented ones, their neighbours, junk) and content types.
fn route_cases(runner: &mut TestRunner, paths: &[String], n: usize) -> Vec<Case> {
    let methods = prop::sample::select(vec![
        "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO",
    ]);
    let suffix = prop_oneof![
        Just(String::new()),
        "/[a-zA-Z0-9._~-]{0,16}",
        Just("/%FF%FE".to_string()),
        Just("/%00".to_string()),
        Just("/../..".to_string()),
        Just("//".to_string()),
        "\\?[a-z_]{1,8}=[a-zA-Z0-9%]{0,12}",
        (1usize..4000).prop_map(|n| format!("/{}", "z".repeat(n))),
    ];
    let content_type = prop::option::of(prop::sample::select(vec![
        "application/json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
        "application/json; charset=latin1",
        "x/garbage;;=",
    ]));
    let body = prop_oneof![
        Just(Vec::new()),
        prop::collection::vec(any::<u8>(), 0..256),
        any_json().prop_map(|v| serde_json::to_vec(&v).unwrap()),
    ];
    let path = prop::sample::select(paths.to_vec());
    draw(runner, (methods, path, suffix, content_type, body), n)
        .into_iter()
        .map(|(method, path, suffix, content_type, body)| Case {
            method: method.into(),
            path: format!(
                "{}{suffix}",
                path.replace("{id}", "d1")
                    .replace("{trace_id}", "0af7651916cd43dd8448eb211c80319c")
            ),
            content_type: content_type.map(str::to_string),
            body,
        })
        .collect()
}

/// 10,000 levels of arrays or objects, alone and as a field of each seed.
fn deep_cases() -> Vec<Case> {
    let depth = 10_000;
    let arrays = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    let objects = format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth));
    let mut cases = Vec::new();
    for (method, path, body) in seeds() {
        for deep in [&arrays, &objects] {
            cases.push(Case {
                method: method.into(),
                path: path.into(),
                content_type: Some("application/json".into()),
                body: deep.clone().into_bytes(),
            });
            let mut text = serde_json::to_string(&body).unwrap();
            let first = body.as_object().unwrap().keys().next().unwrap().clone();
            text = format!("{{\"{first}\": {deep}, {}", &text[1..]);
            cases.push(Case {
                method: method.into(),
                path: path.into(),
                content_type: Some("application/json".into()),
                body: text.into_bytes(),
            });
        }
    }
    cases
}

/// What an answer must be: below 500, and for a 4xx the error shape of the document with the
/// field at fault first in its message. Streams must not carry a server error either.
async fn check(app: &TestApp, doc: &Value, case: &Case) -> Result<u16, String> {
    let method = reqwest::Method::from_bytes(case.method.as_bytes()).unwrap();
    let mut req = app
        .client
        .request(method, app.url(&case.path))
        .body(case.body.clone());
    if let Some(t) = &case.content_type {
        req = req.header("content-type", t.as_str());
    }
    let r = req
        .timeout(std::time::Duration::from_secs(30))
        .send()
        .await
        .map_err(|e| format!("no answer ({e}) to {}", case.describe()))?;
    let status = r.status().as_u16();
    let kind = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = r.text().await.unwrap_or_default();
    let fail = |why: String| {
        Err(format!(
            "{why}: {} -> {status} {text:.300}",
            case.describe()
        ))
    };
    if status >= 500 {
        return fail("a server error".into());
    }
    if kind.starts_with("text/event-stream") {
        for data in text.lines().filter_map(|l| l.strip_prefix("data:")) {
            if data.contains("\"server_error\"") {
                return fail("a server error inside the stream".into());
            }
        }
    }
    if (400..500).contains(&status) && case.method != "HEAD" {
        let Ok(body) = serde_json::from_str::<Value>(&text) else {
            return fail("a 4xx that is not JSON".into());
        };
        let schema = json!({"$ref": "#/components/schemas/ErrorBody"});
        if let Err(e) = validate(doc, &schema, &body, "body") {
            return fail(format!("not the error shape ({e})"));
        }
        let message = body["error"]["message"].as_str().unwrap_or("");
        let field = message.split_once(": ").map(|(f, _)| f);
        let named = field.is_some_and(|f| !f.is_empty() && !f.contains(char::is_whitespace));
        // A refusal for load names no field; every other names the one at fault.
        if status != 429 && !named {
            return fail("a 4xx whose message does not start with a field".into());
        }
        if let (Some(param), Some(f)) = (body["error"]["param"].as_str(), field) {
            if param != f {
                return fail(format!(
                    "param {param:?} is not the field the message names"
                ));
            }
        }
    }
    Ok(status)
}

/// Sends the cases 16 at a time; returns the statuses seen, or every broken rule.
async fn run(app: &TestApp, doc: &Value, cases: &[Case]) -> Result<Vec<u16>, Vec<String>> {
    let results: Vec<Result<u16, String>> = futures::stream::iter(cases)
        .map(|c| check(app, doc, c))
        .buffer_unordered(16)
        .collect()
        .await;
    let (ok, errors): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
    if errors.is_empty() {
        Ok(ok.into_iter().map(Result::unwrap).collect())
    } else {
        Err(errors.into_iter().map(Result::unwrap_err).collect())
    }
}

fn tally(statuses: &[u16]) -> String {
    let mut counts = std::collections::BTreeMap::new();
    for s in statuses {
        *counts.entry(s).or_insert(0) += 1;
    }
    format!("{counts:?}")
}

#[tokio::test]
async fn generated_requests_never_get_a_server_error_and_refusals_name_the_field() {
    let app = spawn_fake_app(FakeGenerator {
        tokens: 3,
        token_us: 0,
    })
    .await;
    let doc = fetch_document(&app).await;
    let paths: Vec<String> = doc["paths"].as_object().unwrap().keys().cloned().collect();
    let mut runner = runner();
    let started = std::time::Instant::now();
    let mut cases = body_cases(&mut runner, 2400);
    cases.extend(byte_cases(&mut runner, 300));
    cases.extend(route_cases(&mut runner, &paths, 800));
    cases.extend(deep_cases());
    let statuses = match run(&app, &doc, &cases).await {
        Ok(s) => s,
        Err(errors) => panic!(
            "{} of {} cases broke a rule; the first ones:\n{}",
            errors.len(),
            cases.len(),
            errors
                .iter()
                .take(8)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        ),
    };
    println!(
        "{} cases in {:.1} s, statuses {}",
        cases.len(),
        started.elapsed().as_secs_f64(),
        tally(&statuses)
    );
    // The mutations reach the handlers: some are answered, most refused.
    assert!(
        statuses.iter().filter(|&&s| s == 200).count() > 100,
        "{}",
        tally(&statuses)
    );
    assert!(
        statuses.iter().filter(|&&s| s == 400).count() > 1000,
        "{}",
        tally(&statuses)
    );
    let (status, health) = app.get("/health").await;
    assert_eq!((status, health["status"].as_str()), (200, Some("ok")));
    app.stop().await;
}

#[tokio::test]
async fn unknown_fields_are_refused_by_name_where_the_schema_is_closed() {
    let app = spawn_fake_app(FakeGenerator::new(2)).await;
    let doc = fetch_document(&app).await;
    let mut checked = 0;
    for (method, path, mut body) in seeds() {
        let schema = &doc["paths"][path][method.to_lowercase()]["requestBody"]["content"]
            ["application/json"]["schema"];
        let name = schema["$ref"].as_str().unwrap().rsplit('/').next().unwrap();
        assert_eq!(
            doc["components"]["schemas"][name]["additionalProperties"], false,
            "{path}"
        );
        let (status, ok) = app.post(path, &body).await;
        assert_eq!(status, 200, "{path}: the seed itself is valid: {ok}");
        body["zz_not_a_field"] = json!(1);
        let (status, e) = app.post(path, &body).await;
        assert_eq!(status, 400, "{path}: {e}");
        assert_eq!(e["error"]["param"], "zz_not_a_field", "{path}: {e}");
        checked += 1;
    }
    assert_eq!(checked, seeds().len());
    app.stop().await;
}

/// Not a check: serves the router over stand-in stages for `RAGSCOPE_FUZZ_SERVE_S` seconds
/// (default 600) and prints its address, for a schemathesis run on the generating endpoints
/// that real models would make too slow (docs/FUZZING.md).
#[tokio::test]
#[ignore]
async fn serve_fakes_for_schemathesis() {
    let app = spawn_fake_app(FakeGenerator {
        tokens: 3,
        token_us: 0,
    })
    .await;
    let seconds = std::env::var("RAGSCOPE_FUZZ_SERVE_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    println!("serving {} for {seconds} s", app.base);
    tokio::time::sleep(std::time::Duration::from_secs(seconds)).await;
    app.stop().await;
}
