//! `/openapi.json` checked against reality: the document's 3.1 structure, the router's routes
//! (as written in `src/api/`) and the API reference's table (docs/API.md) against its paths,
//! and real answers of a real server (real models and store) against its response schemas,
//! with a small JSON Schema check written here (the subset utoipa emits).

use std::collections::BTreeSet;

use serde_json::{json, Value};

use crate::helpers::{repo_dir, spawn_app, spawn_fake_app};

/// The methods an OpenAPI path item may hold.
const METHODS: &[&str] = &[
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

pub async fn fetch_document(app: &crate::helpers::TestApp) -> Value {
    let (status, doc) = app.get("/openapi.json").await;
    assert_eq!(status, 200, "{doc}");
    doc
}

/// Every `(METHOD, path)` the document describes.
pub fn operations(doc: &Value) -> BTreeSet<(String, String)> {
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for m in METHODS {
            if item.get(*m).is_some() {
                ops.insert((m.to_uppercase(), path.clone()));
            }
        }
    }
    ops
}

// ---- A JSON Schema check: $ref, type (and type lists), enum, const, properties, required,
// additionalProperties, items, oneOf/anyOf/allOf, minimum/maximum, minItems/maxItems.

/// Checks `value` against `schema`; the error says where and why.
pub fn validate(doc: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r
            .strip_prefix("#/components/schemas/")
            .ok_or_else(|| format!("{at}: unsupported $ref {r}"))?;
        let target = &doc["components"]["schemas"][name];
        if target.is_null() {
            return Err(format!("{at}: $ref {r} resolves to nothing"));
        }
        return validate(doc, target, value, at);
    }
    if let Some(types) = schema.get("type") {
        let names: Vec<&str> = match types {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            _ => return Err(format!("{at}: bad type {types}")),
        };
        if !names.iter().any(|t| has_type(value, t)) {
            return Err(format!("{at}: expected {names:?}, got {value}"));
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
        if !allowed.contains(value) {
            return Err(format!("{at}: {value} is not one of {allowed:?}"));
        }
    }
    if let Some(c) = schema.get("const") {
        if c != value {
            return Err(format!("{at}: expected {c}, got {value}"));
        }
    }
    if let Some(n) = value.as_f64() {
        if schema["minimum"].as_f64().is_some_and(|min| n < min) {
            return Err(format!(
                "{at}: {n} is below the minimum {}",
                schema["minimum"]
            ));
        }
        if schema["maximum"].as_f64().is_some_and(|max| n > max) {
            return Err(format!(
                "{at}: {n} is above the maximum {}",
                schema["maximum"]
            ));
        }
    }
    if let Some(obj) = value.as_object() {
        if let Some(required) = schema.get("required").and_then(Value::as_array) {
            for r in required.iter().filter_map(Value::as_str) {
                if !obj.contains_key(r) {
                    return Err(format!("{at}: missing required {r:?} in {value}"));
                }
            }
        }
        let props = schema.get("properties").and_then(Value::as_object);
        for (k, v) in obj {
            match props.and_then(|p| p.get(k)) {
                Some(s) => validate(doc, s, v, &format!("{at}.{k}"))?,
                None => match schema.get("additionalProperties") {
                    Some(Value::Bool(false)) => {
                        return Err(format!("{at}: property {k:?} is not in the schema"))
                    }
                    Some(s @ Value::Object(_)) => validate(doc, s, v, &format!("{at}.{k}"))?,
                    _ => {}
                },
            }
        }
    }
    if let Some(items) = value.as_array() {
        if schema["minItems"]
            .as_u64()
            .is_some_and(|n| (items.len() as u64) < n)
        {
            return Err(format!("{at}: fewer than {} items", schema["minItems"]));
        }
        if schema["maxItems"]
            .as_u64()
            .is_some_and(|n| (items.len() as u64) > n)
        {
            return Err(format!("{at}: more than {} items", schema["maxItems"]));
        }
        if let Some(item) = schema.get("items").filter(|i| i.is_object()) {
            for (i, v) in items.iter().enumerate() {
                validate(doc, item, v, &format!("{at}[{i}]"))?;
            }
        }
    }
    if let Some(all) = schema.get("allOf").and_then(Value::as_array) {
        for s in all {
            validate(doc, s, value, at)?;
        }
    }
    if let Some(any) = schema.get("anyOf").and_then(Value::as_array) {
        let errors: Vec<String> = any
            .iter()
            .filter_map(|s| validate(doc, s, value, at).err())
            .collect();
        if errors.len() == any.len() {
            return Err(format!("{at}: matches no anyOf branch: {errors:?}"));
        }
    }
    if let Some(one) = schema.get("oneOf").and_then(Value::as_array) {
        let results: Vec<Result<(), String>> =
            one.iter().map(|s| validate(doc, s, value, at)).collect();
        let matched = results.iter().filter(|r| r.is_ok()).count();
        if matched != 1 {
            let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
            return Err(format!(
                "{at}: {value} matches {matched} oneOf branches, not 1: {errors:?}"
            ));
        }
    }
    Ok(())
}

fn has_type(value: &Value, t: &str) -> bool {
    match t {
        "null" => value.is_null(),
        "boolean" => value.is_boolean(),
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "number" => value.is_number(),
        "integer" => value.is_i64() || value.is_u64(),
        _ => false,
    }
}

/// The schema of `(method, path)`'s `status` answer in `content_type` (a range such as `4XX`
/// when the exact status is not listed).
pub fn response_schema<'a>(
    doc: &'a Value,
    method: &str,
    path: &str,
    status: u16,
    content_type: &str,
) -> Result<&'a Value, String> {
    let op = &doc["paths"][path][method.to_lowercase()];
    if op.is_null() {
        return Err(format!("{method} {path} is not in the document"));
    }
    let responses = &op["responses"];
    let range = format!("{}XX", status / 100);
    let response = [status.to_string(), range]
        .into_iter()
        .map(|k| &responses[k.as_str()])
        .find(|r| !r.is_null())
        .ok_or_else(|| format!("{method} {path}: status {status} is not documented"))?;
    let schema = &response["content"][content_type]["schema"];
    if schema.is_null() {
        return Err(format!(
            "{method} {path} {status}: content type {content_type} is not documented: {response}"
        ));
    }
    Ok(schema)
}

/// Sends a request and checks its answer against the document: JSON bodies whole, SSE
/// streams event by event (all but the closing `[DONE]`). Returns the status and the body
/// (for SSE, the events' data as an array).
pub async fn checked(
    app: &crate::helpers::TestApp,
    doc: &Value,
    method: &str,
    template: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = app.client.request(method.parse().unwrap(), app.url(path));
    if let Some(b) = &body {
        req = req.json(b);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let kind = r
        .headers()
        .get("content-type")
        .map(|v| {
            v.to_str()
                .unwrap()
                .split(';')
                .next()
                .unwrap()
                .trim()
                .to_string()
        })
        .unwrap_or_default();
    let text = r.text().await.unwrap();
    if status == 204 {
        assert!(text.is_empty());
        response_schema(doc, method, template, status, "application/json")
            .expect_err("a 204 documents no body");
        return (status, Value::Null);
    }
    let schema = response_schema(doc, method, template, status, &kind)
        .unwrap_or_else(|e| panic!("{e}; body {text}"));
    let value = if kind == "text/event-stream" {
        let events: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim)
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{d}: {e}")))
            .collect();
        assert!(!events.is_empty(), "{method} {path}: no events in {text}");
        for (i, e) in events.iter().enumerate() {
            validate(doc, schema, e, &format!("event {i}"))
                .unwrap_or_else(|err| panic!("{method} {path} {status}: {err}"));
        }
        Value::Array(events)
    } else if kind == "application/json" {
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        validate(doc, schema, &v, "body")
            .unwrap_or_else(|err| panic!("{method} {path} {status}: {err}"));
        v
    } else {
        Value::String(text)
    };
    (status, value)
}

#[tokio::test]
async fn the_schema_check_refuses_what_does_not_match() {
    let app = spawn_fake_app(crate::fakes::FakeGenerator::new(2)).await;
    let doc = fetch_document(&app).await;
    let error = json!({"$ref": "#/components/schemas/ErrorBody"});
    let good = json!({"error": {"message": "x: bad", "type": "invalid_request_error", "param": "x", "code": null}});
    validate(&doc, &error, &good, "body").unwrap();
    for bad in [
        json!({"error": {"message": 1, "type": "t", "param": null, "code": null}}),
        json!({"error": {"type": "t", "param": null, "code": null}}),
        json!({"error": {"message": "m", "type": "t", "param": null, "code": null, "extra": 1}}),
        json!([]),
    ] {
        assert!(validate(&doc, &error, &bad, "body").is_err(), "{bad}");
    }
    // oneOf means exactly one: a chunk is not an error, an error is not a chunk.
    let event = json!({"$ref": "#/components/schemas/ChatStreamEvent"});
    validate(&doc, &event, &good, "event").unwrap();
    assert!(validate(&doc, &event, &json!({"id": "x"}), "event").is_err());
    app.stop().await;
}

#[tokio::test]
async fn the_document_is_openapi_3_1_and_every_reference_resolves() {
    let app = spawn_fake_app(crate::fakes::FakeGenerator::new(2)).await;
    let doc = fetch_document(&app).await;
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3.1."),
        "{}",
        doc["openapi"]
    );
    assert_eq!(doc["info"]["title"], "ragscope");
    assert!(doc["info"]["version"].is_string());
    let schemes = doc["components"]["securitySchemes"].as_object().unwrap();
    let mut ids = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        assert!(path.starts_with('/'), "{path}");
        for (key, op) in item.as_object().unwrap() {
            assert!(
                METHODS.contains(&key.as_str()),
                "{path}: unexpected key {key}"
            );
            let at = format!("{key} {path}");
            let id = op["operationId"]
                .as_str()
                .unwrap_or_else(|| panic!("{at}: no operationId"));
            assert!(ids.insert(id.to_string()), "{at}: operationId {id} twice");
            let responses = op["responses"].as_object().unwrap();
            assert!(!responses.is_empty(), "{at}: no responses");
            for code in responses.keys() {
                let valid = code.parse::<u16>().is_ok_and(|c| (100..600).contains(&c))
                    || ["1XX", "2XX", "3XX", "4XX", "5XX", "default"].contains(&code.as_str());
                assert!(valid, "{at}: response key {code}");
            }
            assert!(
                responses.contains_key("4XX") && responses.contains_key("5XX"),
                "{at}"
            );
            // Each {param} in the template is declared as a path parameter, and nothing else is.
            let declared: BTreeSet<&str> = op["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["in"] == "path")
                .map(|p| {
                    assert_eq!(p["required"], true, "{at}: path parameters are required");
                    p["name"].as_str().unwrap()
                })
                .collect();
            let templated: BTreeSet<&str> = path
                .split('/')
                .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
                .collect();
            assert_eq!(declared, templated, "{at}");
            for requirement in op["security"]
                .as_array()
                .unwrap_or_else(|| panic!("{at}: no security"))
            {
                for name in requirement.as_object().unwrap().keys() {
                    assert!(schemes.contains_key(name), "{at}: unknown scheme {name}");
                }
            }
            if let Some(body) = op.get("requestBody") {
                assert!(
                    body["content"].as_object().is_some_and(|c| !c.is_empty()),
                    "{at}"
                );
            }
        }
    }
    // Every $ref anywhere points at a schema that exists.
    fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    out.push(r);
                }
                m.values().for_each(|x| refs(x, out));
            }
            Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(all.len() > 20, "{}", all.len());
    for r in all {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("{r}"));
        assert!(
            doc["components"]["schemas"][name].is_object(),
            "{r} resolves to nothing"
        );
    }
    // Admin routes say so; probes are open; the rest take any key.
    let security = |m: &str, p: &str| doc["paths"][p][m]["security"].clone();
    assert_eq!(
        security("post", "/v1/documents"),
        json!([{"admin_key": []}])
    );
    assert_eq!(security("get", "/debug/traces"), json!([{"admin_key": []}]));
    assert_eq!(
        security("post", "/v1/chat/completions"),
        json!([{"api_key": []}])
    );
    assert_eq!(security("get", "/health"), json!([]));
    // Bodies that refuse unknown fields by name are closed in the schema too.
    for name in [
        "ChatBody",
        "CompletionBody",
        "QueryBody",
        "CreateBody",
        "DocumentBody",
        "TokenizeBody",
        "StreamOptions",
    ] {
        assert_eq!(
            doc["components"]["schemas"][name]["additionalProperties"], false,
            "{name}"
        );
    }
    app.stop().await;
}

/// `.route("path", get(..).put(..))` calls in the router's source: what the server serves.
fn router_routes() -> BTreeSet<(String, String)> {
    let mut routes = BTreeSet::new();
    for file in [
        "crates/server/src/api/mod.rs",
        "crates/server/src/api/page.rs",
    ] {
        let text = std::fs::read_to_string(repo_dir().join(file)).unwrap();
        let mut rest = text.as_str();
        while let Some(at) = rest.find(".route(") {
            rest = &rest[at + ".route(".len()..];
            // The call's arguments: up to the parenthesis that closes `.route(`.
            let mut depth = 1;
            let end = rest
                .char_indices()
                .find(|&(_, c)| {
                    depth += match c {
                        '(' => 1,
                        ')' => -1,
                        _ => 0,
                    };
                    depth == 0
                })
                .map(|(i, _)| i)
                .unwrap();
            let args = &rest[..end];
            let path = args.split('"').nth(1).unwrap().to_string();
            let handlers = &args[args.find(',').unwrap()..];
            for m in ["get", "post", "put", "delete", "patch"] {
                let called = handlers.match_indices(&format!("{m}(")).any(|(i, _)| {
                    !handlers[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_')
                });
                if called {
                    routes.insert((m.to_uppercase(), path.clone()));
                }
            }
        }
    }
    routes
}

#[tokio::test]
async fn every_route_is_documented_and_every_documented_route_is_served() {
    let app = spawn_fake_app(crate::fakes::FakeGenerator::new(2)).await;
    let doc = fetch_document(&app).await;
    let documented = operations(&doc);
    let routed = router_routes();
    assert!(routed.len() > 20, "{routed:?}");
    let missing: Vec<_> = routed.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&routed).collect();
    assert!(
        missing.is_empty(),
        "routes not in /openapi.json: {missing:?}"
    );
    assert!(extra.is_empty(), "documented but not routed: {extra:?}");
    // The live router agrees: each documented operation reaches a handler (not the fallback),
    // and each method a path does not document is a JSON 405.
    for path in doc["paths"].as_object().unwrap().keys() {
        let concrete = path
            .replace("{id}", "no-such-doc")
            .replace("{trace_id}", "0af7651916cd43dd8448eb211c80319c");
        for m in ["GET", "POST", "PUT", "DELETE", "PATCH"] {
            let r = app
                .client
                .request(m.parse().unwrap(), app.url(&concrete))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            if documented.contains(&(m.to_string(), path.clone())) {
                assert_ne!(status, 405, "{m} {path}: {body}");
                let message = body["error"]["message"].as_str().unwrap_or("");
                assert!(!message.starts_with("path: no route"), "{m} {path}: {body}");
            } else {
                assert_eq!(status, 405, "{m} {path}: {body}");
                assert_eq!(body["error"]["param"], "method", "{m} {path}: {body}");
            }
        }
    }
    app.stop().await;
}

/// `METHOD /path` pairs in the first column of the HTTP API table of docs/API.md.
fn reference_operations() -> BTreeSet<(String, String)> {
    let reference = std::fs::read_to_string(repo_dir().join("docs/API.md")).unwrap();
    let section = reference
        .split("\n## HTTP API\n")
        .nth(1)
        .expect("an HTTP API section");
    let mut ops = BTreeSet::new();
    for line in section.lines().skip_while(|l| !l.starts_with('|')) {
        if !line.starts_with('|') {
            break;
        }
        let first = line.split('|').nth(1).unwrap();
        for span in first.split('`').skip(1).step_by(2) {
            let Some((methods, path)) = span.split_once(' ') else {
                continue;
            };
            let path = path.split('?').next().unwrap().to_string();
            for m in methods.split('|') {
                ops.insert((m.to_string(), path.clone()));
            }
        }
    }
    ops
}

#[tokio::test]
async fn the_api_reference_table_lists_exactly_the_documented_operations() {
    let app = spawn_fake_app(crate::fakes::FakeGenerator::new(2)).await;
    let documented = operations(&fetch_document(&app).await);
    let listed = reference_operations();
    let missing: Vec<_> = documented.difference(&listed).collect();
    let extra: Vec<_> = listed.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "docs/API.md's HTTP API table lacks {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "docs/API.md's HTTP API table lists {extra:?}, which /openapi.json has not"
    );
    app.stop().await;
}

#[tokio::test]
async fn real_answers_match_their_response_schemas() {
    let app = spawn_app().await;
    let doc = fetch_document(&app).await;
    macro_rules! c {
        ($m:expr, $t:expr, $p:expr, $b:expr $(,)?) => {
            checked(&app, &doc, $m, $t, $p, $b)
        };
    }
    let (s, ingested) = c!(
        "POST",
        "/v1/documents",
        "/v1/documents",
        Some(json!({"documents": crate::helpers::fixtures()})),
    )
    .await;
    assert_eq!(s, 200, "{ingested}");
    let short = json!({"max_tokens": 3, "top_k": 2});
    let mut query = json!({"query": "What is the capital of Zorbia?", "logprobs": 2});
    merge(&mut query, &short);
    assert_eq!(
        c!(
            "POST",
            "/v1/rag/query",
            "/v1/rag/query",
            Some(query.clone())
        )
        .await
        .0,
        200
    );
    query["stream"] = json!(true);
    let (s, events) = c!("POST", "/v1/rag/query", "/v1/rag/query", Some(query)).await;
    assert_eq!(s, 200);
    assert!(events.as_array().unwrap().len() >= 3, "{events}");
    let mut chat = json!({"model": "ragscope", "messages": [{"role": "user", "content": "Who invented the flumox?"}],
        "logprobs": true, "top_logprobs": 2, "n": 2});
    merge(&mut chat, &short);
    let chat_path = "/v1/chat/completions";
    assert_eq!(
        c!("POST", chat_path, chat_path, Some(chat.clone())).await.0,
        200
    );
    chat["stream"] = json!(true);
    chat["stream_options"] = json!({"include_usage": true});
    assert_eq!(c!("POST", chat_path, chat_path, Some(chat)).await.0, 200);
    let (_, models) = c!("GET", "/v1/models", "/v1/models", None).await;
    let plain = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .find(|id| id.ends_with("-plain"))
        .expect("a plain model")
        .to_string();
    // The prompt's own log-probabilities (what loglikelihood evaluation asks for).
    let completion = json!({"model": plain, "prompt": "The capital of Zorbia is", "max_tokens": 0,
        "logprobs": 2, "echo": true});
    assert_eq!(
        c!(
            "POST",
            "/v1/completions",
            "/v1/completions",
            Some(completion.clone())
        )
        .await
        .0,
        200
    );
    let mut streamed = completion;
    streamed["stream"] = json!(true);
    streamed["max_tokens"] = json!(2);
    streamed["logprobs"] = json!(null);
    streamed["stream_options"] = json!({"include_usage": true});
    assert_eq!(
        c!("POST", "/v1/completions", "/v1/completions", Some(streamed))
            .await
            .0,
        200
    );
    let (_, ready) = c!("GET", "/ready", "/ready", None).await;
    let embedder = ready["models"]["embedder"].as_str().unwrap().to_string();
    for format in ["float", "base64"] {
        let body =
            json!({"model": embedder, "input": ["hello", "world"], "encoding_format": format});
        assert_eq!(
            c!("POST", "/v1/embeddings", "/v1/embeddings", Some(body))
                .await
                .0,
            200
        );
    }
    let rerank = json!({"query": "garden tool", "documents": ["a flumox", "an island"], "return_documents": true});
    assert_eq!(
        c!("POST", "/v1/rerank", "/v1/rerank", Some(rerank)).await.0,
        200
    );
    for body in [
        json!({"content": "Hello there"}),
        json!({"content": "Hello there", "with_pieces": true}),
        json!({"content": ""}),
        json!({"model": plain, "prompt": "Hello", "return_token_strs": true}),
    ] {
        assert_eq!(
            c!("POST", "/tokenize", "/tokenize", Some(body)).await.0,
            200
        );
    }
    for body in [
        json!({"tokens": [1, 2, 3]}),
        json!({"tokens": [1, 2], "model": plain}),
    ] {
        assert_eq!(
            c!("POST", "/detokenize", "/detokenize", Some(body)).await.0,
            200
        );
    }
    assert_eq!(c!("GET", "/health", "/health", None).await.0, 200);
    assert_eq!(
        c!("GET", "/debug/traces", "/debug/traces?limit=1", None)
            .await
            .0,
        200
    );
    assert_eq!(
        c!("DELETE", "/debug/traces", "/debug/traces", None).await.0,
        200
    );
    assert_eq!(
        c!("GET", "/openapi.json", "/openapi.json", None).await.0,
        200
    );
    let (s, deleted) = c!("DELETE", "/v1/documents/{id}", "/v1/documents/zorbia", None).await;
    assert_eq!((s, deleted["id"].as_str()), (200, Some("zorbia")));
    // Refusals have the error shape, whatever refused them.
    for (method, template, path, body, status) in [
        (
            "POST",
            chat_path,
            chat_path,
            json!({"model": "ragscope", "messages": [], "tools_x": 1}),
            400,
        ),
        (
            "POST",
            chat_path,
            chat_path,
            json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
            404,
        ),
        (
            "POST",
            "/v1/rag/query",
            "/v1/rag/query",
            json!({"query": "q", "top_k": 0}),
            400,
        ),
        (
            "POST",
            "/v1/completions",
            "/v1/completions",
            json!({"model": plain, "prompt": "x", "best_of": 3}),
            400,
        ),
        (
            "DELETE",
            "/v1/documents/{id}",
            "/v1/documents/zorbia",
            json!(null),
            404,
        ),
        ("GET", "/admin/faults", "/admin/faults", json!(null), 404),
    ] {
        let body = Some(body).filter(|b| !b.is_null());
        let (s, e) = c!(method, template, path, body).await;
        assert_eq!(s, status, "{method} {path}: {e}");
        assert!(e["error"]["message"].is_string(), "{e}");
    }
    app.stop().await;
}

fn merge(into: &mut Value, from: &Value) {
    for (k, v) in from.as_object().unwrap() {
        into[k] = v.clone();
    }
}
