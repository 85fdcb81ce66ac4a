//! Every name the server's telemetry uses, in one place: the stages of a request, the other span
//! names, attribute keys and metric names. Code refers to these constants, never to a string
//! literal, so a name is spelled once and the README's span and metric catalogues can be checked
//! against this file (`crates/server/tests/api/catalogue.rs`).
//!
//! Attribute keys follow the OpenTelemetry conventions where one exists (`gen_ai.*`, `db.*`,
//! `http.*`, `rpc.*`, `server.*`, `error.type`); `rag.*` keys are this server's own.

/// One stage of a request. Its span name, metric label, per-stage service name and fault key
/// are all derived from this, so they cannot drift apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StageKind {
    /// Waiting for a model worker.
    Queue,
    /// Embedding the query (or the texts of `/v1/embeddings`, or a document's chunks).
    Embed,
    /// Vector search.
    Retrieve,
    /// Reordering the candidates.
    Rerank,
    /// Choosing, from the reranked passages, the sentences (or passages) that go into the
    /// prompt, within a token budget.
    Context,
    /// Building the prompt within the context window.
    Prompt,
    /// Generation: the `chat {model}` span, parent of `prefill` and `decode`.
    Generate,
    /// The prompt in one pass (a child of `Generate`).
    Prefill,
    /// One token per step (a child of `Generate`).
    Decode,
    /// A streamed response: opened → last event written.
    Stream,
    /// A JSON response: worker done → last byte written.
    Respond,
    /// One document stored (`POST /v1/documents`, gRPC `Ingest`).
    Ingest,
}

impl StageKind {
    pub const ALL: [StageKind; 12] = [
        StageKind::Queue,
        StageKind::Embed,
        StageKind::Retrieve,
        StageKind::Rerank,
        StageKind::Context,
        StageKind::Prompt,
        StageKind::Generate,
        StageKind::Prefill,
        StageKind::Decode,
        StageKind::Stream,
        StageKind::Respond,
        StageKind::Ingest,
    ];

    /// The first word of the stage's span name (the GenAI operation name for model stages).
    pub const fn span_prefix(self) -> &'static str {
        match self {
            StageKind::Queue => "queue",
            StageKind::Embed => "embeddings",
            StageKind::Retrieve => "retrieval",
            StageKind::Rerank => "rerank",
            StageKind::Context => "context",
            StageKind::Prompt => "prompt",
            StageKind::Generate => "chat",
            StageKind::Prefill => "prefill",
            StageKind::Decode => "decode",
            StageKind::Stream => "stream",
            StageKind::Respond => "respond",
            StageKind::Ingest => "ingest",
        }
    }

    /// The span name: the prefix, then what the stage works on (`embeddings all-MiniLM-L6-v2`,
    /// `retrieval git-doc`) where there is one.
    pub fn span_name(self, subject: Option<&str>) -> std::borrow::Cow<'static, str> {
        match subject {
            Some(s) => format!("{} {s}", self.span_prefix()).into(),
            None => self.span_prefix().into(),
        }
    }

    /// The stage a span name belongs to, from its first word.
    pub fn of_span_name(name: &str) -> Option<StageKind> {
        let first = name.split(' ').next()?;
        StageKind::ALL
            .into_iter()
            .find(|k| k.span_prefix() == first)
    }

    /// The `rag.stage` label of `ragscope.stage.duration`. `None` for generation, whose time is
    /// recorded as its two parts, prefill and decode.
    pub const fn metric_label(self) -> Option<&'static str> {
        Some(match self {
            StageKind::Queue => "queue",
            StageKind::Embed => "embed",
            StageKind::Retrieve => "retrieve",
            StageKind::Rerank => "rerank",
            StageKind::Context => "context",
            StageKind::Prompt => "prompt",
            StageKind::Generate => return None,
            StageKind::Prefill => "prefill",
            StageKind::Decode => "decode",
            StageKind::Stream => "stream",
            StageKind::Respond => "respond",
            StageKind::Ingest => "ingest",
        })
    }

    /// The `service.name` the stage is exported under when per-stage services are on
    /// (`RAGSCOPE_STAGE_SERVICES`); `None` keeps the parent's (prefill and decode stay with
    /// generation, an ingest with its request).
    pub const fn service(self) -> Option<&'static str> {
        Some(match self {
            StageKind::Queue => "ragscope-queue",
            StageKind::Embed => "ragscope-embed",
            StageKind::Retrieve => "ragscope-retrieve",
            StageKind::Rerank => "ragscope-rerank",
            StageKind::Context => "ragscope-context",
            StageKind::Prompt => "ragscope-prompt",
            StageKind::Generate => "ragscope-generate",
            StageKind::Stream | StageKind::Respond => "ragscope-respond",
            StageKind::Prefill | StageKind::Decode | StageKind::Ingest => return None,
        })
    }

    /// Whether the CPU profile is labelled with the stage's span while it runs. Each label
    /// change makes the profiler cut its sample buffer, so only the stages that compute are.
    pub const fn profiled(self) -> bool {
        matches!(
            self,
            StageKind::Embed
                | StageKind::Retrieve
                | StageKind::Rerank
                | StageKind::Context
                | StageKind::Generate
        )
    }

    /// The `gen_ai.operation.name` of a model stage.
    pub const fn operation(self) -> Option<&'static str> {
        match self {
            StageKind::Embed => Some("embeddings"),
            StageKind::Generate => Some("chat"),
            _ => None,
        }
    }
}

/// Every per-stage service name once, in pipeline order.
pub fn stage_services() -> Vec<&'static str> {
    let mut services: Vec<&'static str> = Vec::new();
    for service in StageKind::ALL.iter().filter_map(|k| k.service()) {
        if !services.contains(&service) {
            services.push(service);
        }
    }
    services
}

/// The key of the decode steps' service ([`crate::install_background_services`]): batched decode
/// steps are exported under `{service.name}-steps`, apart from the requests.
pub const STEPS_SERVICE: &str = "ragscope-steps";

/// The key of the server's own lifecycle service: `startup` and `telemetry_change` are
/// exported under `{service.name}-lifecycle`, apart from the requests.
pub const LIFECYCLE_SERVICE: &str = "ragscope-lifecycle";

/// `provider.name` of every model stage: the models run in this process.
pub const PROVIDER: &str = "ragscope";

/// Declares a module of name constants and the list of all of them.
macro_rules! names {
    ($(#[$meta:meta])* $module:ident { $($(#[$doc:meta])* $name:ident = $value:literal,)* }) => {
        $(#[$meta])*
        pub mod $module {
            $($(#[$doc])* pub const $name: &str = $value;)*
            /// Every name in this module.
            pub const ALL: &[&str] = &[$($value),*];
        }
    };
}

names! {
    /// Span names that are not a [`StageKind`](super::StageKind) of their own: the parts of a
    /// stage, and roots of work outside any request.
    span {
        /// Tokenizing a batch (under `embeddings`).
        TOKENIZE = "tokenize",
        /// A model's forward pass (under `embeddings`, `rerank`).
        FORWARD = "forward",
        /// The wait for the prefill turn, only when another request is prefilling.
        PREFILL_QUEUE = "prefill_queue",
        /// A RAG request's prompt head prefilled into the prefix cache beside `embeddings` and
        /// `retrieval` (`overlap`), a child of the request.
        WARM_PREFILL = "warm_prefill",
        /// One decode step: under a request's `decode` with `RAGSCOPE_TOKEN_TRACE=spans`, and
        /// a batched step of several requests as the root of a trace of its own
        /// (`--decode-step-spans`).
        DECODE_STEP = "decode_step",
        /// GPU work of a phase, `gpu {phase}` (CUDA builds).
        GPU = "gpu",
        /// The root of benchmark work.
        BENCH = "bench",
        /// The root of evaluation work.
        EVAL = "eval",
        /// The root of `ragscope replay` work.
        REPLAY = "replay",
        /// A gRPC call served without the trace layer (never as served; tests).
        GRPC = "grpc",
        /// The server's start, a trace of its own: `load_models`, `open_store`,
        /// `ingest_corpus` (each document's `ingest` and `build_index` under it).
        STARTUP = "startup",
        LOAD_MODELS = "load_models",
        OPEN_STORE = "open_store",
        INGEST_CORPUS = "ingest_corpus",
        BUILD_INDEX = "build_index",
        /// A change of telemetry's run-time settings (`/admin/telemetry`), a root of its own
        /// with one event of the same name per setting changed.
        TELEMETRY_CHANGE = "telemetry_change",
    }
}

names! {
    /// Span event names.
    event {
        /// One generated token, on the `decode` span.
        TOKEN = "token",
        /// A failure snapshot was queued, on the failing `chat {model}` span.
        SNAPSHOT = "snapshot",
        /// One chunk of a prompt prefilled, on the `prefill` span, at the chunk's end.
        PREFILL_CHUNK = "prefill_chunk",
    }
}

names! {
    /// Attribute keys of spans and metric points.
    attr {
        // Requests.
        HTTP_REQUEST_METHOD = "http.request.method",
        HTTP_ROUTE = "http.route",
        URL_PATH = "url.path",
        HTTP_RESPONSE_STATUS_CODE = "http.response.status_code",
        RPC_SYSTEM = "rpc.system",
        RPC_SERVICE = "rpc.service",
        RPC_METHOD = "rpc.method",
        RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code",
        ERROR_TYPE = "error.type",
        REQUEST_ID = "rag.request.id",
        QUERY_TEXT = "rag.query.text",
        ANSWER_TEXT = "rag.answer.text",
        QUEUE_DEPTH_AT_ENTRY = "rag.queue.depth_at_entry",
        QUEUE_EXPECTED_WAIT_MS = "rag.queue.expected_wait_ms",
        STREAM_EVENTS = "rag.stream.events",
        STREAM_STALLED_MS = "rag.stream.stalled_ms",
        /// How a `warm_prefill` ended: `prefilled`, `called_off`, `skipped` or `failed`.
        OVERLAP_OUTCOME = "rag.overlap.outcome",
        // GenAI.
        GEN_AI_OPERATION_NAME = "gen_ai.operation.name",
        GEN_AI_PROVIDER_NAME = "gen_ai.provider.name",
        GEN_AI_REQUEST_MODEL = "gen_ai.request.model",
        GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens",
        GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature",
        GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p",
        GEN_AI_REQUEST_SEED = "gen_ai.request.seed",
        GEN_AI_REQUEST_STREAM = "gen_ai.request.stream",
        GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences",
        GEN_AI_REQUEST_PRESENCE_PENALTY = "gen_ai.request.presence_penalty",
        GEN_AI_REQUEST_FREQUENCY_PENALTY = "gen_ai.request.frequency_penalty",
        GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count",
        GEN_AI_RESPONSE_MODEL = "gen_ai.response.model",
        GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons",
        GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens",
        GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens",
        /// Prompt tokens read from the prefix cache instead of computed (OTel GenAI).
        GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens",
        GEN_AI_SERVER_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token",
        GEN_AI_EMBEDDINGS_DIMENSION_COUNT = "gen_ai.embeddings.dimension.count",
        GEN_AI_DATA_SOURCE_ID = "gen_ai.data_source.id",
        GEN_AI_RERANK_CANDIDATE_COUNT = "gen_ai.rerank.candidate.count",
        GEN_AI_TOKEN_INDEX = "gen_ai.token.index",
        GEN_AI_TOKEN_ID = "gen_ai.token.id",
        GEN_AI_TOKEN_TYPE = "gen_ai.token.type",
        // Embedding and reranking.
        INPUTS = "rag.inputs",
        BATCH_SIZE = "rag.batch.size",
        BATCH_PADDED_TOKENS = "rag.batch.padded_tokens",
        CACHE_HIT = "rag.cache.hit",
        RERANK_MOVED = "rag.rerank.moved",
        RERANK_ENTRIES_LOOKED_UP = "rag.rerank.entries_looked_up",
        // Retrieval.
        DB_SYSTEM_NAME = "db.system.name",
        DB_COLLECTION_NAME = "db.collection.name",
        DB_OPERATION_NAME = "db.operation.name",
        DB_RESPONSE_RETURNED_ROWS = "db.response.returned_rows",
        SERVER_ADDRESS = "server.address",
        SERVER_PORT = "server.port",
        RETRIEVAL_TOP_K = "rag.retrieval.top_k",
        RETRIEVAL_INDEX = "rag.retrieval.index",
        RETRIEVAL_FILTERED = "rag.retrieval.filtered",
        RETRIEVAL_LEXICAL_TOP_K = "rag.retrieval.lexical.top_k",
        RETRIEVAL_LEXICAL_HITS = "rag.retrieval.lexical.hits",
        RETRIEVAL_LEXICAL_ADDED = "rag.retrieval.lexical.added",
        RETRIEVAL_LOOKUP_ADDED = "rag.retrieval.lookup.added",
        // A Qdrant server or cluster: how collections are laid out, written and read, and
        // how a call is tried (`retrieve::cluster`); tries beyond the first a call needed.
        QDRANT_SHARDS = "rag.qdrant.shards",
        QDRANT_REPLICATION_FACTOR = "rag.qdrant.replication_factor",
        QDRANT_WRITE_CONSISTENCY_FACTOR = "rag.qdrant.write_consistency_factor",
        QDRANT_READ_CONSISTENCY = "rag.qdrant.read_consistency",
        QDRANT_WRITE_ORDERING = "rag.qdrant.write_ordering",
        QDRANT_TIMEOUT_MS = "rag.qdrant.timeout_ms",
        QDRANT_RETRIES = "rag.qdrant.retries",
        QDRANT_RETRIED = "rag.qdrant.retried",
        // Prompt and generation.
        CONTEXT_MODE = "rag.context.mode",
        CONTEXT_METHOD = "rag.context.method",
        CONTEXT_ORDER = "rag.context.order",
        CONTEXT_TERMS = "rag.context.terms",
        CONTEXT_TERMS_NAMED = "rag.context.terms_named",
        CONTEXT_TERM_TOKENS = "rag.context.term_tokens",
        CONTEXT_ENTRIES_LOOKED_UP = "rag.context.entries_looked_up",
        CONTEXT_BUDGET = "rag.context.budget",
        CONTEXT_SENTENCES_IN = "rag.context.sentences_in",
        CONTEXT_SENTENCES_OUT = "rag.context.sentences_out",
        CONTEXT_SENTENCES_CACHED = "rag.context.sentences_cached",
        CONTEXT_TOKENS_IN = "rag.context.tokens_in",
        CONTEXT_TOKENS_OUT = "rag.context.tokens_out",
        CONTEXT_PASSAGES_OUT = "rag.context.passages_out",
        PROMPT_PASSAGES_KEPT = "rag.prompt.passages_kept",
        PROMPT_PASSAGES_DROPPED = "rag.prompt.passages_dropped",
        PROMPT_TRUNCATED = "rag.prompt.truncated",
        REQUEST_REPETITION_PENALTY = "rag.request.repetition_penalty",
        REQUEST_NO_REPEAT_NGRAM_SIZE = "rag.request.no_repeat_ngram_size",
        REQUEST_PENALIZE_PROMPT = "rag.request.penalize_prompt",
        REQUEST_CONTEXT_BIAS = "rag.request.context_bias",
        REQUEST_COPY_BIAS = "rag.request.copy_bias",
        PREFILL_TOKENS_PER_SECOND = "rag.prefill.tokens_per_second",
        PREFILL_CACHED_TOKENS = "rag.prefill.cached_tokens",
        PREFILL_COMPUTED_TOKENS = "rag.prefill.computed_tokens",
        /// How the prefill projections multiplied: `bf16-amx`, `bf16`, `int8`, `f32` or
        /// `bf16-emulated`.
        PREFILL_PRECISION = "rag.prefill.precision",
        /// Tokens per prefill chunk (`--prefill-chunk-tokens`) and the chunks this prompt took.
        PREFILL_CHUNK_SIZE = "rag.prefill.chunk_size",
        PREFILL_CHUNKS = "rag.prefill.chunks",
        /// On a `prefill_chunk` event: its first position, its tokens, its time.
        PREFILL_CHUNK_START = "rag.prefill.chunk.start",
        PREFILL_CHUNK_TOKENS = "rag.prefill.chunk.tokens",
        PREFILL_CHUNK_DURATION_MS = "rag.prefill.chunk.duration_ms",
        DECODE_TOKENS_PER_SECOND = "rag.decode.tokens_per_second",
        DECODE_BATCH_SIZE_MAX = "rag.decode.batch_size.max",
        DECODE_BATCH_SIZE_MEAN = "rag.decode.batch_size.mean",
        // Batched decode steps (`decode_step` roots) and the links to them.
        DECODE_BATCH_SIZE = "rag.decode.batch_size",
        DECODE_BATCH_SLOT = "rag.decode.batch.slot",
        DECODE_STEP_INDEX = "rag.decode.step.index",
        DECODE_STEP_WAIT_MS = "rag.decode.step.wait_ms",
        /// Positions a step computed: one per member, plus the drafts it verified.
        DECODE_STEP_ROWS = "rag.decode.step.rows",
        DECODE_MEMBERS_REQUEST_IDS = "rag.decode.members.request_ids",
        DECODE_MEMBERS_TRACE_IDS = "rag.decode.members.trace_ids",
        DECODE_MEMBERS_SPAN_IDS = "rag.decode.members.span_ids",
        DECODE_MEMBERS_TOKENS = "rag.decode.members.tokens",
        DECODE_WINDOW_STEPS = "rag.decode.window.steps",
        DECODE_WINDOW_BUSY_MS = "rag.decode.window.busy_ms",
        DECODE_STEPS = "rag.decode.steps",
        DECODE_STEP_SPANS = "rag.decode.step_spans",
        DECODE_STEP_LINKS_DROPPED = "rag.decode.step_links.dropped",
        // Speculative decoding from the prompt (`--speculation`), on the `decode` span: the
        // draft tokens verified, those the model agreed with, the steps that verified a
        // draft, and accepted / drafted.
        SPEC_METHOD = "rag.spec.method",
        SPEC_DRAFTED = "rag.spec.drafted_tokens",
        SPEC_ACCEPTED = "rag.spec.accepted_tokens",
        SPEC_STEPS = "rag.spec.steps",
        SPEC_ACCEPTANCE_RATE = "rag.spec.acceptance_rate",
        GPU_DEVICE_MS = "gpu.device_ms",
        GPU_HOST_LAUNCH_MS = "gpu.host_launch_ms",
        GPU_GAP_MS = "gpu.gap_ms",
        // Per-request quality of a RAG answer, on the request span (issue #17).
        QUALITY_CONTEXT_FILL_RATIO = "rag.quality.context_fill_ratio",
        QUALITY_PREFIX_CACHE_HIT_RATIO = "rag.quality.prefix_cache_hit_ratio",
        QUALITY_RETRIEVAL_TO_GENERATION_GAP_MS = "rag.quality.retrieval_to_generation_gap_ms",
        QUALITY_CONTEXT_RELEVANCE = "rag.quality.context_relevance",
        QUALITY_ANSWER_CONFIDENCE = "rag.quality.answer_confidence",
        QUALITY_OUTPUT_TOKENS = "rag.quality.output_tokens",
        // Documents.
        DOCUMENT_ID = "rag.document.id",
        INGEST_CHUNKS = "rag.ingest.chunks",
        /// On `ingest_corpus`: the corpus's documents, and whether an earlier start had
        /// ingested them all (then nothing is ingested again).
        CORPUS_DOCUMENTS = "rag.corpus.documents",
        CORPUS_ALREADY_INGESTED = "rag.corpus.already_ingested",
        // Injected faults (every key under `rag.fault.`).
        FAULT_PREFIX = "rag.fault.",
        FAULT_ERROR = "rag.fault.error",
        FAULT_CPU_BURN_MS = "rag.fault.cpu_burn_ms",
        FAULT_DELAY_MS = "rag.fault.delay_ms",
        FAULT_DELAY_DISTRIBUTION = "rag.fault.delay.distribution",
        FAULT_TOKEN_DELAY_MS = "rag.fault.token_delay_ms",
        FAULT_DELAYED_TOKENS = "rag.fault.delayed_tokens",
        FAULT_PLAN = "rag.fault.plan",
        // Failure snapshots.
        SNAPSHOT_ID = "rag.snapshot.id",
        SNAPSHOT_REASON = "rag.snapshot.reason",
        // Profiles.
        PYROSCOPE_PROFILE_ID = "pyroscope.profile.id",
        // Metric point labels.
        STAGE = "rag.stage",
        CACHE = "cache",
        RESULT = "result",
        REASON = "reason",
        KIND = "kind",
        TENANT = "rag.tenant",
        OUTCOME = "outcome",
        LISTENER = "listener",
        VERSION = "version",
        SERVICE_NAME = "service.name",
        SERVICE_VERSION = "service.version",
        // A `telemetry_change` event: which setting, from what, to what.
        TELEMETRY_SETTING = "rag.telemetry.setting",
        TELEMETRY_FROM = "rag.telemetry.from",
        TELEMETRY_TO = "rag.telemetry.to",
        // OpenInference (Arize Phoenix and the RAG UIs that read it), beside the GenAI names:
        // the span's kind on every span, the project on the resource, and the documents a
        // retriever or reranker handled as `{list}.{i}.{document key}`.
        OPENINFERENCE_SPAN_KIND = "openinference.span.kind",
        OPENINFERENCE_PROJECT_NAME = "openinference.project.name",
        INPUT_VALUE = "input.value",
        INPUT_MIME_TYPE = "input.mime_type",
        OUTPUT_VALUE = "output.value",
        OUTPUT_MIME_TYPE = "output.mime_type",
        RETRIEVAL_DOCUMENTS = "retrieval.documents",
        RERANKER_INPUT_DOCUMENTS = "reranker.input_documents",
        RERANKER_OUTPUT_DOCUMENTS = "reranker.output_documents",
        RERANKER_QUERY = "reranker.query",
        RERANKER_MODEL_NAME = "reranker.model_name",
        RERANKER_TOP_K = "reranker.top_k",
        DOC_ID = "document.id",
        DOC_SCORE = "document.score",
        DOC_CONTENT = "document.content",
        DOC_METADATA = "document.metadata",
        EMBEDDING_MODEL_NAME = "embedding.model_name",
        LLM_MODEL_NAME = "llm.model_name",
        LLM_TOKEN_COUNT_PROMPT = "llm.token_count.prompt",
        LLM_TOKEN_COUNT_COMPLETION = "llm.token_count.completion",
        LLM_TOKEN_COUNT_TOTAL = "llm.token_count.total",
        LLM_TOKEN_COUNT_CACHE_READ = "llm.token_count.prompt_details.cache_read",
    }
}

/// The OpenInference span kind of a span, from its name: what Phoenix and the UIs built on
/// OpenInference show a span as. A request and the stages that only move data are `CHAIN`.
pub fn openinference_kind(span_name: &str) -> &'static str {
    match StageKind::of_span_name(span_name) {
        Some(StageKind::Embed) => "EMBEDDING",
        Some(StageKind::Retrieve) => "RETRIEVER",
        Some(StageKind::Rerank) => "RERANKER",
        Some(StageKind::Generate) => "LLM",
        _ => "CHAIN",
    }
}

names! {
    /// Metric instrument names (OpenTelemetry spelling; `/metrics` renders the Prometheus one).
    metric {
        REQUEST_DURATION = "gen_ai.server.request.duration",
        TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token",
        TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token",
        STAGE_DURATION = "ragscope.stage.duration",
        TOKEN_USAGE = "ragscope.token.usage",
        REQUESTS_IN_FLIGHT = "ragscope.requests.in_flight",
        CACHE_REQUESTS = "ragscope.cache.requests",
        FAULTS_INJECTED = "ragscope.faults.injected",
        QUEUE_DEPTH = "ragscope.queue.depth",
        /// Jobs a model worker is running now.
        JOBS_RUNNING = "ragscope.jobs.running",
        SPANS_DROPPED = "ragscope.spans.dropped",
        /// OTLP profiles (one per upload interval) not exported.
        PROFILES_DROPPED = "ragscope.profiles.dropped",
        STAGE_EVENTS_DROPPED = "ragscope.stage_events.dropped",
        KV_CACHE_BYTES = "ragscope.kv_cache.bytes",
        KV_CACHE_TOKENS = "ragscope.kv_cache.tokens",
        PREFIX_CACHE_LOOKUPS = "ragscope.prefix_cache.lookups",
        PREFIX_CACHE_HITS = "ragscope.prefix_cache.hits",
        PREFIX_CACHE_HIT_TOKENS = "ragscope.prefix_cache.hit_tokens",
        PREFIX_CACHE_EVICTIONS = "ragscope.prefix_cache.evictions",
        PREFIX_CACHE_BYTES = "ragscope.prefix_cache.bytes",
        DECODE_BATCH_SIZE = "ragscope.decode.batch_size",
        GPU_MEMORY_USED = "ragscope.gpu.memory.used",
        GPU_MEMORY_PEAK = "ragscope.gpu.memory.peak",
        GPU_MEMORY_TOTAL = "ragscope.gpu.memory.total",
        GPU_KV_CACHE_BYTES = "ragscope.gpu.kv_cache.bytes",
        BUILD_INFO = "ragscope.build.info",
        QUEUE_EXPECTED_WAIT = "ragscope.queue.expected_wait",
        ADMISSION_REJECTED = "ragscope.admission.rejected",
        AUTH_REJECTED = "ragscope.auth.rejected",
        TENANT_REQUESTS = "ragscope.tenant.requests",
        TENANT_TOKENS = "ragscope.tenant.tokens",
        PROCESS_CPU_TIME = "process.cpu.time",
        ANSWER_OUTPUT_TOKENS = "ragscope.answer.output_tokens",
        ANSWER_CONFIDENCE = "ragscope.answer.confidence",
        CONTEXT_FILL_RATIO = "ragscope.context.fill_ratio",
        CONTEXT_RELEVANCE = "ragscope.context.relevance",
        PREFIX_CACHE_HIT_RATIO = "ragscope.prefix_cache.hit_ratio",
        RETRIEVAL_TO_GENERATION_GAP = "ragscope.retrieval_to_generation.gap",
        SNAPSHOTS = "ragscope.snapshots",
        STREAM_STALLS = "ragscope.stream.stalls",
        CONNECTIONS_OPEN = "ragscope.connections.open",
        CONNECTIONS_REJECTED = "ragscope.connections.rejected",
        /// The time between two tokens of one generation, one sample per gap.
        TOKEN_INTERVAL = "ragscope.token.interval",
        /// Tokens per finished generation: `gen_ai.token.type` input, output (all choices)
        /// or output_longest (the longest choice).
        REQUEST_TOKENS = "ragscope.request.tokens",
        /// Finished generations by `reason` (stop, length, …).
        REQUESTS_FINISHED = "ragscope.requests.finished",
        /// Tokens per model step: a prefill chunk's, or a decode step's (one per sequence).
        STEP_TOKENS = "ragscope.step.tokens",
        /// Speculative decoding: draft tokens by `kind` (drafted, accepted), and the drafts
        /// (steps that verified one).
        SPEC_TOKENS = "ragscope.spec.tokens",
        SPEC_DRAFTS = "ragscope.spec.drafts",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_names_lead_back_to_their_stage() {
        for kind in StageKind::ALL {
            assert_eq!(
                StageKind::of_span_name(&kind.span_name(Some("m"))),
                Some(kind)
            );
            assert_eq!(StageKind::of_span_name(kind.span_prefix()), Some(kind));
        }
        assert_eq!(StageKind::of_span_name("POST /v1/rag/query"), None);
    }

    #[test]
    fn stream_and_respond_share_one_service() {
        let services = stage_services();
        assert_eq!(services.len(), 8, "{services:?}");
        assert_eq!(services.last(), Some(&"ragscope-respond"));
        assert_eq!(StageKind::Stream.service(), StageKind::Respond.service());
    }

    #[test]
    fn stages_have_their_openinference_kinds() {
        assert_eq!(
            openinference_kind("embeddings all-MiniLM-L6-v2"),
            "EMBEDDING"
        );
        assert_eq!(openinference_kind("retrieval ragscope"), "RETRIEVER");
        assert_eq!(openinference_kind("rerank rrf-dense-bm25"), "RERANKER");
        assert_eq!(openinference_kind("chat SmolLM2-135M-Instruct"), "LLM");
        for name in [
            "POST /v1/rag/query",
            "context",
            "prefill",
            "decode_step",
            "queue",
        ] {
            assert_eq!(openinference_kind(name), "CHAIN", "{name}");
        }
    }

    #[test]
    fn no_name_is_declared_twice() {
        for all in [span::ALL, event::ALL, attr::ALL, metric::ALL] {
            let unique: std::collections::BTreeSet<&&str> = all.iter().collect();
            assert_eq!(unique.len(), all.len(), "{all:?}");
        }
    }
}
