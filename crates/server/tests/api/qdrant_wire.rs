//! The remote store's wire side, against a STAND-IN for a Qdrant server: an in-process tonic
//! server that answers just the Collections/Points calls the store makes (with Qdrant's own
//! protobuf messages from `qdrant-client`), keeps points in a list, and records the metadata
//! and requests it receives. It is not Qdrant: filters are only recorded, not evaluated, and
//! ranking is insertion order.
//!
//! It stays for what a real server cannot show: the gRPC metadata each call carried. Qdrant
//! records no traces and logs no request metadata, so only a stand-in can prove that
//! `traceparent` arrives on every call a request makes and names the retrieval span, and that
//! the API key is sent. Everything a real server can show runs against one: filters and
//! the store's contract in `store_conformance`, a dead or hung server in `qdrant_server`,
//! a cluster's faults in `qdrant_cluster` (`scripts/qdrant-faults`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use opentelemetry::Value as OtelValue;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use qdrant_client::qdrant::points_selector::PointsSelectorOneOf;
use qdrant_client::qdrant::r#match::MatchValue;
use qdrant_client::qdrant::vectors_config::Config as VectorsConfigKind;
use qdrant_client::qdrant::{
    condition::ConditionOneOf, CollectionConfig, CollectionInfo, CollectionOperationResponse,
    CollectionParams, CountPoints, CountResponse, CountResult, CreateCollection,
    CreateFieldIndexCollection, DeletePoints, Distance, Filter, GetCollectionInfoRequest,
    GetCollectionInfoResponse, GetPoints, GetResponse, Modifier, PayloadSchemaInfo, PointStruct,
    PointsOperationResponse, QueryPoints, QueryResponse, RetrievedPoint, ScoredPoint,
    SparseVectorConfig, UpdateResult, UpdateStatus, UpsertPoints, VectorParams, VectorsConfig,
};
use rag::retrieve::remote::RemoteStore;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::server::NamedService;
use tonic::Status;

use crate::fakes::FakeGenerator;
use crate::helpers::spawn_fake_app_with_store_and;

const API_KEY: &str = "stand-in-key";

/// One call as the stand-in saw it.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    traceparent: Option<String>,
    api_key: Option<String>,
}

impl Seen {
    fn of(req: &http::Request<tonic::body::Body>) -> Seen {
        let header = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        Seen {
            path: req.uri().path().to_string(),
            traceparent: header("traceparent"),
            api_key: header("api-key"),
        }
    }
}

#[derive(Default)]
struct State {
    /// Name and dimension of the one collection, once created.
    collection: Option<(String, u64)>,
    indexes: Vec<(String, i32)>,
    points: Vec<PointStruct>,
    calls: Vec<Seen>,
    query_filters: Vec<Option<Filter>>,
    /// The sparse vectors the collection was created with, reported back by `get`.
    sparse: Option<SparseVectorConfig>,
    /// Per query: the vector names its prefetches search (`bm25` for the lexical one).
    query_prefetches: Vec<Vec<String>>,
}

type Shared = Arc<Mutex<State>>;

/// The doc_id a `must: [doc_id == x]` filter asks for.
fn doc_id_of(filter: &Filter) -> Option<String> {
    filter.must.iter().find_map(|c| match &c.condition_one_of {
        Some(ConditionOneOf::Field(f)) if f.key == "doc_id" => {
            match f.r#match.as_ref()?.match_value.as_ref()? {
                MatchValue::Keyword(k) => Some(k.clone()),
                _ => None,
            }
        }
        _ => None,
    })
}

/// Whether `p` is a chunk of `doc` that `filter`'s `must_not` has-id conditions do not spare
/// (how a replaced document's stale chunks are selected).
fn selected(filter: &Filter, doc: &Option<String>, p: &PointStruct) -> bool {
    let spared = filter.must_not.iter().any(|c| match &c.condition_one_of {
        Some(ConditionOneOf::HasId(h)) => p.id.as_ref().is_some_and(|id| h.has_id.contains(id)),
        _ => false,
    });
    (doc.is_none() || payload_doc_id(p) == *doc) && !spared
}

fn payload_doc_id(p: &PointStruct) -> Option<String> {
    p.payload.get("doc_id").and_then(|v| match &v.kind {
        Some(qdrant_client::qdrant::value::Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    })
}

fn completed() -> PointsOperationResponse {
    PointsOperationResponse {
        result: Some(UpdateResult {
            operation_id: Some(0),
            status: UpdateStatus::Completed as i32,
        }),
        ..Default::default()
    }
}

impl State {
    fn get(&self, r: GetCollectionInfoRequest) -> Result<GetCollectionInfoResponse, Status> {
        let Some((_, dim)) = self
            .collection
            .clone()
            .filter(|(n, _)| *n == r.collection_name)
        else {
            return Err(Status::not_found(format!(
                "Collection `{}` doesn't exist!",
                r.collection_name
            )));
        };
        let params = CollectionParams {
            vectors_config: Some(VectorsConfig {
                config: Some(VectorsConfigKind::Params(VectorParams {
                    size: dim,
                    distance: Distance::Cosine as i32,
                    ..Default::default()
                })),
            }),
            sparse_vectors_config: self.sparse.clone(),
            ..Default::default()
        };
        Ok(GetCollectionInfoResponse {
            result: Some(CollectionInfo {
                config: Some(CollectionConfig {
                    params: Some(params),
                    ..Default::default()
                }),
                payload_schema: self
                    .indexes
                    .iter()
                    .map(|(f, t)| {
                        (
                            f.clone(),
                            PayloadSchemaInfo {
                                data_type: *t,
                                ..Default::default()
                            },
                        )
                    })
                    .collect(),
                points_count: Some(self.points.len() as u64),
                indexed_vectors_count: Some(0),
                ..Default::default()
            }),
            time: 0.0,
        })
    }

    fn create(&mut self, r: CreateCollection) -> Result<CollectionOperationResponse, Status> {
        let Some(VectorsConfigKind::Params(p)) = r.vectors_config.and_then(|v| v.config) else {
            return Err(Status::invalid_argument(
                "stand-in: expected one unnamed vector",
            ));
        };
        if p.distance != Distance::Cosine as i32 {
            return Err(Status::invalid_argument("stand-in: expected cosine"));
        }
        self.collection = Some((r.collection_name, p.size));
        self.sparse = r.sparse_vectors_config;
        Ok(CollectionOperationResponse {
            result: true,
            time: 0.0,
        })
    }

    fn upsert(&mut self, r: UpsertPoints) -> Result<PointsOperationResponse, Status> {
        for point in r.points {
            self.points.retain(|p| p.id != point.id);
            self.points.push(point);
        }
        Ok(completed())
    }

    fn query(&mut self, r: QueryPoints) -> Result<QueryResponse, Status> {
        self.query_filters.push(r.filter);
        self.query_prefetches
            .push(r.prefetch.iter().filter_map(|p| p.using.clone()).collect());
        let limit = r.limit.unwrap_or(10) as usize;
        Ok(QueryResponse {
            result: self
                .points
                .iter()
                .take(limit)
                .map(|p| ScoredPoint {
                    id: p.id.clone(),
                    payload: p.payload.clone(),
                    score: 0.5,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
    }

    fn retrieve(&self, r: GetPoints) -> Result<GetResponse, Status> {
        Ok(GetResponse {
            result: self
                .points
                .iter()
                .filter(|p| r.ids.contains(p.id.as_ref().unwrap()))
                .map(|p| RetrievedPoint {
                    id: p.id.clone(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
    }

    fn count(&self, r: CountPoints) -> Result<CountResponse, Status> {
        let filter = r.filter.unwrap_or_default();
        let doc = doc_id_of(&filter);
        let count = self
            .points
            .iter()
            .filter(|p| selected(&filter, &doc, p))
            .count();
        Ok(CountResponse {
            result: Some(CountResult {
                count: count as u64,
            }),
            ..Default::default()
        })
    }

    fn delete(&mut self, r: DeletePoints) -> Result<PointsOperationResponse, Status> {
        let Some(PointsSelectorOneOf::Filter(filter)) =
            r.points.and_then(|p| p.points_selector_one_of)
        else {
            return Err(Status::invalid_argument("stand-in: expected a filter"));
        };
        let doc = doc_id_of(&filter);
        self.points.retain(|p| !selected(&filter, &doc, p));
        Ok(completed())
    }
}

/// One unary call: decode `Req`, answer with `handle`'s `Resp` or status.
struct Unary<F>(Option<F>);

impl<Req, Resp, F> tonic::server::UnaryService<Req> for Unary<F>
where
    F: FnOnce(Req) -> Result<Resp, Status> + Send + 'static,
    Req: Send + 'static,
    Resp: Send + 'static,
{
    type Response = Resp;
    type Future = std::future::Ready<Result<tonic::Response<Resp>, Status>>;

    fn call(&mut self, request: tonic::Request<Req>) -> Self::Future {
        let handle = self.0.take().expect("called once");
        std::future::ready(handle(request.into_inner()).map(tonic::Response::new))
    }
}

async fn unary<Req, Resp>(
    req: http::Request<tonic::body::Body>,
    handle: impl FnOnce(Req) -> Result<Resp, Status> + Send + 'static,
) -> http::Response<tonic::body::Body>
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
{
    let codec = tonic_prost::ProstCodec::<Resp, Req>::default();
    tonic::server::Grpc::new(codec)
        .unary(Unary(Some(handle)), req)
        .await
}

async fn dispatch(
    state: Shared,
    req: http::Request<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    let path = req.uri().path().to_string();
    let seen = Seen::of(&req);
    state.lock().unwrap().calls.push(seen);
    let s = state.clone();
    match path.as_str() {
        "/qdrant.Collections/Get" => unary(req, move |r| s.lock().unwrap().get(r)).await,
        "/qdrant.Collections/Create" => unary(req, move |r| s.lock().unwrap().create(r)).await,
        "/qdrant.Points/CreateFieldIndex" => {
            unary(req, move |r: CreateFieldIndexCollection| {
                let mut s = s.lock().unwrap();
                s.indexes.push((r.field_name, r.field_type.unwrap_or(-1)));
                Ok(completed())
            })
            .await
        }
        "/qdrant.Points/Upsert" => unary(req, move |r| s.lock().unwrap().upsert(r)).await,
        "/qdrant.Points/Query" => unary(req, move |r| s.lock().unwrap().query(r)).await,
        "/qdrant.Points/Get" => unary(req, move |r| s.lock().unwrap().retrieve(r)).await,
        "/qdrant.Points/Count" => unary(req, move |r| s.lock().unwrap().count(r)).await,
        "/qdrant.Points/Delete" => unary(req, move |r| s.lock().unwrap().delete(r)).await,
        other => Status::unimplemented(format!("stand-in: {other}")).into_http(),
    }
}

/// The stand-in as two named gRPC services (`qdrant.Points`, `qdrant.Collections`) sharing
/// one state; `POINTS` picks the name.
#[derive(Clone)]
struct StandIn<const POINTS: bool>(Shared);

impl NamedService for StandIn<true> {
    const NAME: &'static str = "qdrant.Points";
}

impl NamedService for StandIn<false> {
    const NAME: &'static str = "qdrant.Collections";
}

impl<const P: bool> tower::Service<http::Request<tonic::body::Body>> for StandIn<P> {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move { Ok(dispatch(state, req).await) })
    }
}

/// A running stand-in; dropping `stop` ends it.
struct Running {
    stop: oneshot::Sender<()>,
    done: tokio::task::JoinHandle<()>,
}

async fn serve_stand_in(listener: TcpListener, state: Shared) -> Running {
    let (stop, stopped) = oneshot::channel::<()>();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let done = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(StandIn::<true>(state.clone()))
            .add_service(StandIn::<false>(state))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    Running { stop, done }
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(());
        self.done.await.unwrap();
    }
}

fn install_tracer() -> InMemorySpanExporter {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    opentelemetry::global::set_tracer_provider(provider);
    exporter
}

fn span_attr(span: &SpanData, key: &str) -> Option<OtelValue> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

fn traceparent_of(span: &SpanData) -> String {
    format!(
        "00-{}-{}-01",
        span.span_context.trace_id(),
        span.span_context.span_id()
    )
}

async fn open_remote(addr: SocketAddr) -> Result<Arc<RemoteStore>, String> {
    let url = format!("http://{addr}");
    tokio::task::spawn_blocking(move || {
        RemoteStore::open(&url, Some(API_KEY), "wire", 4)
            .map(Arc::new)
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_reaches_qdrant_and_names_the_retrieval_span() {
    let spans = install_tracer();
    let state = Shared::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stand_in = serve_stand_in(listener, state.clone()).await;

    let store = open_remote(addr).await.expect("opens against the stand-in");
    {
        let s = state.lock().unwrap();
        assert_eq!(
            s.collection,
            Some(("wire".to_string(), 4)),
            "collection created"
        );
        let mut indexed: Vec<&str> = s.indexes.iter().map(|(f, _)| f.as_str()).collect();
        indexed.sort();
        assert_eq!(
            indexed,
            ["doc_id", "metadata.title", "source"],
            "keyword indexes created"
        );
        let bm25 = s
            .sparse
            .as_ref()
            .and_then(|c| c.map.get("bm25"))
            .expect("the lexical sparse vector is created");
        assert_eq!(
            bm25.modifier,
            Some(Modifier::Idf as i32),
            "with the IDF modifier"
        );
        let keyword = qdrant_client::qdrant::FieldType::Keyword as i32;
        assert!(s.indexes.iter().all(|(_, t)| *t == keyword));
        // Opening is not part of any request: no trace context, but the key.
        assert!(s.calls.iter().all(|c| c.traceparent.is_none()));
        assert!(s
            .calls
            .iter()
            .all(|c| c.api_key.as_deref() == Some(API_KEY)));
    }
    let opened_calls = state.lock().unwrap().calls.len();
    // Opening again finds everything in place and creates nothing.
    drop(open_remote(addr).await.unwrap());
    {
        let s = state.lock().unwrap();
        let again: Vec<&str> = s.calls[opened_calls..]
            .iter()
            .map(|c| c.path.as_str())
            .collect();
        assert_eq!(again, ["/qdrant.Collections/Get"], "second open only reads");
    }

    let app = spawn_fake_app_with_store_and(
        FakeGenerator::new(3),
        store.clone(),
        &["--lexical-top-k", "5"],
    )
    .await;
    app.ingest(json!([{"id": "doc-1", "text": "Zorbia's capital is Quenta.", "source": "atlas"}]))
        .await;
    let (status, body) = app
        .post(
            "/v1/rag/query",
            &json!({"query": "capital of Zorbia?", "filter": {"source": "atlas"}, "stream": false}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["sources"][0]["doc_id"], "doc-1",
        "payload came back over the wire"
    );
    assert_eq!(body["sources"][0]["source"], "atlas");
    {
        use qdrant_client::qdrant::vectors::VectorsOptions;
        let s = state.lock().unwrap();
        let named = match s.points[0]
            .vectors
            .as_ref()
            .and_then(|v| v.vectors_options.as_ref())
        {
            Some(VectorsOptions::Vectors(named)) => named,
            other => panic!("expected named vectors, got {other:?}"),
        };
        let mut names: Vec<&str> = named.vectors.keys().map(String::as_str).collect();
        names.sort();
        assert_eq!(
            names,
            ["", "bm25"],
            "the dense vector and the chunk's term weights"
        );
    }

    let (status, body) = app
        .client
        .delete(app.url("/v1/documents/doc-1"))
        .send()
        .await
        .map(|r| (r.status().as_u16(), r))
        .unwrap();
    assert_eq!(status, 200, "{:?}", body.text().await);
    assert!(
        state.lock().unwrap().points.is_empty(),
        "deleted on the server"
    );

    let finished = spans.get_finished_spans().unwrap();
    let retrieval = finished
        .iter()
        .find(|s| s.name == "retrieval wire")
        .expect("a retrieval span");
    assert_eq!(
        span_attr(retrieval, "server.address"),
        Some(OtelValue::from("127.0.0.1"))
    );
    assert_eq!(
        span_attr(retrieval, "server.port"),
        Some(OtelValue::I64(i64::from(addr.port())))
    );
    assert_eq!(
        span_attr(retrieval, "db.system.name"),
        Some(OtelValue::from("qdrant"))
    );
    assert_eq!(
        span_attr(retrieval, "rag.retrieval.lexical.top_k"),
        Some(OtelValue::I64(5))
    );
    // The stand-in answers the lexical query with the same one point: found, nothing added.
    assert_eq!(
        span_attr(retrieval, "rag.retrieval.lexical.hits"),
        Some(OtelValue::I64(1))
    );
    assert_eq!(
        span_attr(retrieval, "rag.retrieval.lexical.added"),
        Some(OtelValue::I64(0))
    );

    {
        let s = state.lock().unwrap();
        let by_path: HashMap<&str, Vec<&Seen>> =
            s.calls[opened_calls..]
                .iter()
                .fold(HashMap::new(), |mut m, c| {
                    m.entry(c.path.as_str()).or_default().push(c);
                    m
                });
        // The dense search, then the lexical one (BM25 in a prefetch, rescored densely).
        let query = &by_path["/qdrant.Points/Query"];
        assert_eq!(query.len(), 2);
        assert_eq!(s.query_prefetches, [vec![], vec!["bm25".to_string()]]);
        for call in query {
            assert_eq!(
                call.traceparent.as_deref(),
                Some(traceparent_of(retrieval).as_str()),
                "the searches carry the retrieval span's context"
            );
            assert_eq!(call.api_key.as_deref(), Some(API_KEY));
        }
        // The filter went out as a keyword match on the payload path.
        for sent in &s.query_filters {
            assert_eq!(
                sent.as_ref().expect("a filter was sent"),
                &Filter::must([qdrant_client::qdrant::Condition::matches(
                    "source",
                    MatchValue::Keyword("atlas".into())
                )])
            );
        }

        // Ingest and delete calls carry their own request's spans.
        let ingest = finished
            .iter()
            .find(|s| s.name == "ingest")
            .expect("an ingest span");
        for path in ["/qdrant.Points/Get", "/qdrant.Points/Upsert"] {
            for call in &by_path[path] {
                assert_eq!(
                    call.traceparent.as_deref(),
                    Some(traceparent_of(ingest).as_str()),
                    "{path}"
                );
            }
        }
        let delete_request = finished
            .iter()
            .find(|s| s.name == "DELETE /v1/documents/{id}")
            .expect("the delete request's span");
        let delete = &by_path["/qdrant.Points/Delete"];
        assert_eq!(
            delete[0].traceparent.as_deref(),
            Some(traceparent_of(delete_request).as_str())
        );
    }
    app.stop().await;
    stand_in.stop().await;
}
