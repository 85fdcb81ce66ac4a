//! An in-process OTLP receiver (gRPC and HTTP/protobuf) that keeps what it is sent; over gRPC
//! it takes profiles too (the alpha `v1development` service).

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::profiles::v1development::profiles_service_server::{
    ProfilesService, ProfilesServiceServer,
};
use opentelemetry_proto::tonic::collector::profiles::v1development::{
    ExportProfilesServiceRequest, ExportProfilesServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;

#[derive(Clone, Default)]
pub struct Received {
    pub traces: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
    pub metrics: Arc<Mutex<Vec<ExportMetricsServiceRequest>>>,
    pub profiles: Arc<Mutex<Vec<ExportProfilesServiceRequest>>>,
}

impl Received {
    /// Every span received, with its resource's `service.name`.
    pub fn spans(&self) -> Vec<(String, Span)> {
        let mut out = Vec::new();
        for req in self.traces.lock().unwrap().iter() {
            for rs in &req.resource_spans {
                let service = rs
                    .resource
                    .as_ref()
                    .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                    .and_then(|a| a.value.as_ref())
                    .map(|v| format!("{:?}", v.value))
                    .unwrap_or_default();
                for ss in &rs.scope_spans {
                    for span in &ss.spans {
                        out.push((service.clone(), span.clone()));
                    }
                }
            }
        }
        out
    }

    /// The spans of one trace (hex trace id), with their `service.name`.
    pub fn spans_of(&self, trace_id: &str) -> Vec<(String, Span)> {
        self.spans()
            .into_iter()
            .filter(|(_, s)| hex(&s.trace_id) == trace_id)
            .collect()
    }

    pub fn metric_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for req in self.metrics.lock().unwrap().iter() {
            for rm in &req.resource_metrics {
                for sm in &rm.scope_metrics {
                    names.extend(sm.metrics.iter().map(|m| m.name.clone()));
                }
            }
        }
        names
    }
}

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.traces.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl MetricsService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.metrics.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl ProfilesService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportProfilesServiceRequest>,
    ) -> Result<tonic::Response<ExportProfilesServiceResponse>, tonic::Status> {
        self.profiles.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(
            ExportProfilesServiceResponse::default(),
        ))
    }
}

/// Starts a gRPC receiver; returns its endpoint URL.
pub async fn grpc(received: Received) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(received.clone()))
            .add_service(MetricsServiceServer::new(received.clone()))
            .add_service(ProfilesServiceServer::new(received))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    url
}

/// Starts an HTTP/protobuf receiver (`/v1/traces`, `/v1/metrics`); returns its base URL.
pub async fn http(received: Received) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let traces = received.clone();
    let metrics = received;
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            axum::routing::post(move |body: Bytes| async move {
                traces
                    .traces
                    .lock()
                    .unwrap()
                    .push(ExportTraceServiceRequest::decode(body).unwrap());
                ExportTraceServiceResponse::default().encode_to_vec()
            }),
        )
        .route(
            "/v1/metrics",
            axum::routing::post(move |body: Bytes| async move {
                metrics
                    .metrics
                    .lock()
                    .unwrap()
                    .push(ExportMetricsServiceRequest::decode(body).unwrap());
                ExportMetricsServiceResponse::default().encode_to_vec()
            }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Lower-case hex of an id's bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
