//! The RAG layer's settings, flattened by the binary into the commands that need them (beside
//! the generator's and the sampler's, which are `llm`'s): which embedder and reranker, the
//! store, the pipeline's defaults, fault injection and tenant quotas. Every flag has a
//! `RAGSCOPE_*` variable.

use std::path::PathBuf;

use clap::Args;
use llm::TokenTrace;

use crate::pipeline::context::kinds::{ContextMethod, ContextMode, ContextOrder};
use crate::pipeline::overlap::Overlap;
use crate::prompt::PromptTemplate;

/// `--answer-headers`: what becomes of a passage header an answer begins with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AnswerHeaders {
    /// The header turned into a citation after the first sentence.
    Cite,
    /// The answer as generated.
    Keep,
}
use crate::retrieve::cluster::{Cluster, ReadConsistency, WriteOrdering};

/// The models: where they are unpacked, the embedder and the reranker (the generator's own
/// settings are `llm`'s, beside these).
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Where models are unpacked (one directory per model).
    #[arg(long, env = "RAGSCOPE_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,
    /// Embedder: a manifest name, a local directory, or a model-hub id.
    #[arg(long, env = "RAGSCOPE_EMBED_MODEL", default_value = "all-MiniLM-L6-v2")]
    pub embed_model: String,
    /// Reranker: `fusion` (dense + BM25 rank fusion, offline), `none`, or a cross-encoder given
    /// as a directory or hub id (e.g. cross-encoder/ms-marco-MiniLM-L-6-v2).
    #[arg(long, env = "RAGSCOPE_RERANKER", default_value = "fusion")]
    pub reranker: String,
    /// Fetch missing models on start.
    #[arg(long, env = "RAGSCOPE_FETCH_MODELS", default_value_t = true, action = clap::ArgAction::Set)]
    pub fetch_models: bool,
}

/// The vector store: the embedded engine's directory or a Qdrant server, and how documents
/// are cut into chunks.
#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    /// Where the embedded store and the downloaded corpus live.
    #[arg(long, env = "RAGSCOPE_DATA_DIR", default_value = "data")]
    pub data_dir: PathBuf,
    /// Collection: one Qdrant Edge shard directory under the data dir, or the collection on
    /// the Qdrant server.
    #[arg(long, env = "RAGSCOPE_COLLECTION", default_value = "ragscope")]
    pub collection: String,
    /// A Qdrant server's gRPC URL (e.g. http://qdrant:6334) to store vectors in instead of the
    /// embedded engine; unset = embedded Qdrant Edge in the data dir.
    #[arg(long, env = "RAGSCOPE_QDRANT_URL")]
    pub qdrant_url: Option<String>,
    /// API key for the Qdrant server, sent as `api-key` metadata.
    #[arg(long, env = "RAGSCOPE_QDRANT_API_KEY", hide_env_values = true)]
    pub qdrant_api_key: Option<String>,
    /// Shards of a collection ragscope creates on a Qdrant cluster; unset: Qdrant's own choice
    /// (one per peer).
    #[arg(long, env = "RAGSCOPE_QDRANT_SHARDS", value_parser = clap::value_parser!(u32).range(1..))]
    pub qdrant_shards: Option<u32>,
    /// Copies of each shard of a collection ragscope creates: with 2 or more, one dead peer
    /// loses nothing and reads answer on (a single server keeps one).
    #[arg(long, env = "RAGSCOPE_QDRANT_REPLICATION_FACTOR", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub qdrant_replication_factor: u32,
    /// Copies that must have applied a write before Qdrant acknowledges it (at most the
    /// replication factor; writes fail while fewer copies are up).
    #[arg(long, env = "RAGSCOPE_QDRANT_WRITE_CONSISTENCY", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub qdrant_write_consistency: u32,
    /// Copies a read asks: a number, or `all`, `majority`, `quorum`.
    #[arg(long, env = "RAGSCOPE_QDRANT_READ_CONSISTENCY", default_value = "1", value_parser = ReadConsistency::parse)]
    pub qdrant_read_consistency: ReadConsistency,
    /// Qdrant's write ordering: `weak` (fastest), `medium` or `strong` (through the permanent
    /// leader; writes wait while it is down).
    #[arg(
        long,
        env = "RAGSCOPE_QDRANT_WRITE_ORDERING",
        value_enum,
        default_value = "weak"
    )]
    pub qdrant_write_ordering: WriteOrdering,
    /// The longest one Qdrant call may take, its retries included, in milliseconds.
    #[arg(long, env = "RAGSCOPE_QDRANT_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub qdrant_timeout_ms: u64,
    /// Further tries of a Qdrant call that found the server or a peer unreachable.
    #[arg(long, env = "RAGSCOPE_QDRANT_RETRIES", default_value_t = 2)]
    pub qdrant_retries: u32,
    /// Largest chunk, in embedder tokens.
    #[arg(long, env = "RAGSCOPE_CHUNK_TOKENS", default_value_t = 200)]
    pub chunk_tokens: usize,
    /// Tokens each chunk repeats from the end of the previous one.
    #[arg(long, env = "RAGSCOPE_CHUNK_OVERLAP", default_value_t = 40)]
    pub chunk_overlap: usize,
}

impl StoreArgs {
    /// The remote store's cluster settings.
    pub fn cluster(&self) -> Cluster {
        Cluster {
            shards: self.qdrant_shards,
            replication_factor: self.qdrant_replication_factor,
            write_consistency_factor: self.qdrant_write_consistency,
            read_consistency: self.qdrant_read_consistency,
            write_ordering: self.qdrant_write_ordering,
            timeout: std::time::Duration::from_millis(self.qdrant_timeout_ms),
            retries: self.qdrant_retries,
        }
    }
}

/// What a request gets for what it does not set, and how the pipeline runs.
#[derive(Debug, Clone, Args)]
pub struct PipelineArgs {
    /// Candidates retrieved per query unless the request says otherwise.
    #[arg(long, env = "RAGSCOPE_TOP_K", default_value_t = 20)]
    pub top_k: usize,
    /// Candidates retrieval adds by BM25 over the whole collection, beside the `top_k`
    /// nearest vectors (0: dense retrieval only). The reranker then orders both. Off by
    /// default: on the evaluation set it put the fact in 45 contexts instead of 43 but no more
    /// into answers (20/50 either way), see docs/CONTEXT.md.
    #[arg(long, env = "RAGSCOPE_LEXICAL_TOP_K", default_value_t = 0)]
    pub lexical_top_k: usize,
    /// Passages kept after reranking unless the request says otherwise. Three, not four, since
    /// the copy bias: 28/50 evaluation answers carry the fact against 25/50, from 235 prompt
    /// tokens instead of 285 (docs/CONTEXT.md).
    #[arg(long, env = "RAGSCOPE_RERANK_TOP_N", default_value_t = 3)]
    pub rerank_top_n: usize,
    /// Tokens generated unless the request says otherwise.
    #[arg(long, env = "RAGSCOPE_MAX_TOKENS", default_value_t = 128)]
    pub max_tokens: usize,
    /// What the context stage hands the prompt: the passages' best sentences (`sentences`),
    /// whole passages (`passages`), both within the context budget, or every passage whole
    /// (`off`).
    #[arg(long, env = "RAGSCOPE_CONTEXT", value_enum, default_value_t = ContextMode::Sentences)]
    pub context: ContextMode,
    /// Context tokens per passage kept after reranking: a request's budget is this times its
    /// `rerank_top_n`, unless it sets `context_budget`.
    #[arg(long, env = "RAGSCOPE_CONTEXT_BUDGET", default_value_t = 48)]
    pub context_budget: usize,
    /// How the context stage scores sentences against the question: dense, lexical or hybrid.
    #[arg(long, env = "RAGSCOPE_CONTEXT_METHOD", value_enum, default_value_t = ContextMethod::Hybrid)]
    pub context_method: ContextMethod,
    /// How the prompt lists the context's passages: `best-last` puts the passage holding the
    /// best-scoring sentence last, nearest the question (the small generator copies that one
    /// most often); `rank` keeps rerank order. Markers stay the sources' numbers either way.
    #[arg(long, env = "RAGSCOPE_CONTEXT_ORDER", value_enum, default_value_t = ContextOrder::BestLast)]
    pub context_order: ContextOrder,
    /// A context passage's header names the option or variable whose manual entry its best
    /// sentence belongs to (`git-clone(1) › OPTIONS › --depth <depth>`), so the answer can
    /// name it even when the sentence that does is not kept (docs/CONTEXT.md).
    #[arg(long, env = "RAGSCOPE_CONTEXT_TERMS", default_value_t = true, action = clap::ArgAction::Set)]
    pub context_terms: bool,
    /// A question that names a manual entry (`git stash pop`, `git log --follow`) gets that
    /// entry's definition, and one that says every word of an EXAMPLES title ("How do I undo
    /// git add?": git-reset's `Undo add`) gets that example: retrieval adds the passages
    /// holding them that it missed, the rerank stage puts them first, and in `sentences`
    /// context the defining sentence (or the example's titled sentence and shell lines)
    /// scores best (docs/CONTEXT.md). The reordering needs a reranker.
    #[arg(long, env = "RAGSCOPE_ENTRY_LOOKUP", default_value_t = true, action = clap::ArgAction::Set)]
    pub entry_lookup: bool,
    /// RAG answers end at their first finished paragraph (a blank line after a sentence or a
    /// closed code block) as at a stop string: what the small generator writes after it is a
    /// new, unasked-for answer (docs/CONTEXT.md).
    #[arg(long, env = "RAGSCOPE_END_AT_PARAGRAPH", default_value_t = true, action = clap::ArgAction::Set)]
    pub end_at_paragraph: bool,
    /// An answer that begins by pasting its passage's header (`[3] git-show(1) › PRETTY
    /// FORMATS`): `cite` drops the header and cites `[3]` after the first sentence, `keep`
    /// shows the answer as generated. Requests that ask for logprobs keep it (each logprob
    /// belongs to a token of the text).
    #[arg(long, env = "RAGSCOPE_ANSWER_HEADERS", value_enum, default_value_t = AnswerHeaders::Cite)]
    pub answer_headers: AnswerHeaders,
    /// The RAG prompt's wording (docs/CONTEXT.md compares them).
    #[arg(long, env = "RAGSCOPE_PROMPT_TEMPLATE", value_enum, default_value_t = PromptTemplate::default())]
    pub prompt_template: PromptTemplate,
    /// `on`: a RAG request prefills its prompt's head (system turn, history, question) into the
    /// prefix cache while its query is embedded and searched, so its prefill starts from a hit
    /// (a request's `overlap` overrides it). `off`: every stage in sequence.
    #[arg(long, env = "RAGSCOPE_OVERLAP", value_enum, default_value_t = Overlap::Off)]
    pub overlap: Overlap,
    /// How decode steps appear in traces: events, spans or off.
    #[arg(long, env = "RAGSCOPE_TOKEN_TRACE", value_enum, default_value_t = TokenTrace::Events)]
    pub token_trace: TokenTrace,
    /// Query embeddings kept in an LRU cache (0 turns it off). As many questions' last prompt
    /// token ids are remembered too (~1 KiB each), so admission can tell a prompt the prefix
    /// cache holds from one it must compute.
    #[arg(long, env = "RAGSCOPE_QUERY_CACHE", default_value_t = 1024)]
    pub query_cache: usize,
    /// Sentence vectors the context stage keeps in an LRU cache (0 turns it off): about 1.5 KiB
    /// each with the default embedder, so the default holds ~24 MiB.
    #[arg(long, env = "RAGSCOPE_SENTENCE_CACHE", default_value_t = 16384)]
    pub sentence_cache: usize,
    /// Record query and answer text on spans (off by default: content may be sensitive).
    #[arg(long, env = "RAGSCOPE_CAPTURE_CONTENT", default_value_t = false, action = clap::ArgAction::Set)]
    pub capture_content: bool,
    /// Events a streamed answer may hold unread (the client not reading) before the stall
    /// clock starts.
    #[arg(long, env = "RAGSCOPE_STREAM_BUFFER", default_value_t = 64)]
    pub stream_buffer: usize,
    /// Milliseconds a stream may stay more than `--stream-buffer` events behind before its
    /// generation is cancelled (`rag.stream.stalled_ms` on the chat span).
    #[arg(
        long,
        env = "RAGSCOPE_STREAM_STALL_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub stream_stall_timeout_ms: u64,
}

/// Fault and latency injection: all off unless `--faults true`.
#[derive(Debug, Clone, Default, Args)]
pub struct FaultArgs {
    /// Allow fault and latency injection at all.
    #[arg(long, env = "RAGSCOPE_FAULTS", default_value_t = false, action = clap::ArgAction::Set)]
    pub faults: bool,
    /// The plan injected into every request from the start: JSON, or @file.
    #[arg(long, env = "RAGSCOPE_FAULT_PLAN")]
    pub fault_plan: Option<String>,
    /// Bearer token that `GET|PUT|DELETE /admin/faults` require; without it that endpoint is off.
    #[arg(long, env = "RAGSCOPE_FAULT_ADMIN_TOKEN", hide_env_values = true)]
    pub fault_admin_token: Option<String>,
    /// Let a request bring its own plan in the `x-ragscope-fault` header.
    #[arg(long, env = "RAGSCOPE_FAULT_HEADER", default_value_t = false, action = clap::ArgAction::Set)]
    pub fault_header: bool,
}

/// Tenants' quotas, and how a request without an API key names its tenant.
#[derive(Debug, Clone, Default, Args)]
pub struct TenantArgs {
    /// A tenant's quota, `NAME:rps=R,burst=B,tokens=T,token_burst=TB,share=S` (any of them;
    /// `*` for every tenant without its own). Repeatable; the variable takes a `;`-separated list.
    #[arg(
        long = "tenant-quota",
        env = "RAGSCOPE_TENANT_QUOTAS",
        value_delimiter = ';'
    )]
    pub quotas: Vec<String>,
    /// With API keys off, the W3C baggage member that names a request's tenant (e.g.
    /// `tenant`); it is the client's claim, so with keys on only the key's tenant counts.
    #[arg(long = "tenant-baggage-key", env = "RAGSCOPE_TENANT_BAGGAGE_KEY")]
    pub baggage_key: Option<String>,
}
