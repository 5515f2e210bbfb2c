//! The router's metric catalogue: every family it exports, as a `const` name used at the call
//! sites, and [`ALL`], the families with their type, buckets and help text (its `# HELP` lines).
//! docs/operations.md ("What to watch") lists the same table. Request-level names follow vLLM's
//! (`time_to_first_token_seconds`, `inter_token_latency_seconds`, …) under the `ferry_router_`
//! prefix.

use ferry_proto::metrics::{Buckets, Family};

// Requests, as clients see them.
pub const REQUESTS: &str = "ferry_router_requests_total";
pub const INFLIGHT_REQUESTS: &str = "ferry_router_inflight_requests";
pub const PROMPT_TOKENS: &str = "ferry_router_prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "ferry_router_generation_tokens_total";
pub const REQUEST_QUEUE_TIME: &str = "ferry_router_request_queue_time_seconds";
pub const TIME_TO_FIRST_TOKEN: &str = "ferry_router_time_to_first_token_seconds";
pub const INTER_TOKEN_LATENCY: &str = "ferry_router_inter_token_latency_seconds";
pub const TIME_PER_OUTPUT_TOKEN: &str = "ferry_router_request_time_per_output_token_seconds";
pub const E2E_REQUEST_LATENCY: &str = "ferry_router_e2e_request_latency_seconds";
pub const GOODPUT_REQUESTS: &str = "ferry_router_goodput_requests_total";
pub const SLO_TIME_TO_FIRST_TOKEN: &str = "ferry_router_slo_time_to_first_token_seconds";
pub const SLO_TIME_PER_OUTPUT_TOKEN: &str = "ferry_router_slo_time_per_output_token_seconds";
pub const REQUEST_PROMPT_TOKENS: &str = "ferry_router_request_prompt_tokens";
pub const REQUEST_GENERATION_TOKENS: &str = "ferry_router_request_generation_tokens";
pub const REQUEST_CACHED_PROMPT_TOKENS: &str = "ferry_router_request_cached_prompt_tokens";
pub const KV_TRANSFER_SECONDS: &str = "ferry_router_kv_transfer_seconds";
pub const KV_TRANSFER_BYTES: &str = "ferry_router_kv_transfer_bytes";
pub const OVERHEAD: &str = "ferry_router_overhead_seconds";
pub const MIGRATIONS: &str = "ferry_router_migrations_total";
pub const MIGRATION_STALL: &str = "ferry_router_migration_stall_seconds";
pub const RETRIES: &str = "ferry_router_retries_total";
pub const LOCAL_PREFILLS: &str = "ferry_router_local_prefills_total";
pub const KV_TRANSFERS: &str = "ferry_router_kv_transfers_total";
pub const KV_BYTES: &str = "ferry_router_kv_bytes_total";
// The admission queue.
pub const QUEUE_DEPTH: &str = "ferry_router_queue_depth";
pub const QUEUE_REJECTED: &str = "ferry_router_queue_rejected_total";
// Workers, as the router sees them.
pub const WORKERS: &str = "ferry_router_workers";
pub const WORKERS_MARKED_DEAD: &str = "ferry_router_workers_marked_dead_total";
pub const WORKER_INFLIGHT_REQUESTS: &str = "ferry_router_worker_inflight_requests";
pub const WORKER_OUTSTANDING_PREFILL_TOKENS: &str = "ferry_router_worker_outstanding_prefill_tokens";
pub const WORKER_QUEUED_PREFILL_TOKENS: &str = "ferry_router_worker_queued_prefill_tokens";
pub const WORKER_PREFILL_TOKENS_PER_SECOND: &str = "ferry_router_worker_prefill_tokens_per_second";
pub const WORKER_ESTIMATED_QUEUE: &str = "ferry_router_worker_estimated_queue_seconds";
pub const WORKER_KV_BLOCKS_FREE: &str = "ferry_router_worker_kv_blocks_free";
pub const WORKER_KV_BLOCKS_CAPACITY: &str = "ferry_router_worker_kv_blocks_capacity";
pub const WORKER_PROMISED_KV_BLOCKS: &str = "ferry_router_worker_promised_kv_blocks";
pub const KV_INDEXED_BLOCKS: &str = "ferry_router_kv_indexed_blocks";
pub const KV_INDEXED_BLOCKS_DISTINCT: &str = "ferry_router_kv_indexed_blocks_distinct";
pub const KV_SNAPSHOTS: &str = "ferry_router_kv_snapshots_total";
pub const KV_RESYNCS: &str = "ferry_router_kv_resyncs_total";
pub const PREFIX_ROUTED: &str = "ferry_router_prefix_routed_total";
// The autoscaler.
pub const AUTOSCALE_STEP_TIME_RATIO: &str = "ferry_router_autoscale_step_time_ratio";
pub const AUTOSCALE_OBSERVED_RATE: &str = "ferry_router_autoscale_observed_requests_per_second";
pub const AUTOSCALE_OBSERVED_ATTAINMENT: &str = "ferry_router_autoscale_observed_attainment_ratio";
pub const AUTOSCALE_TARGET_REPLICAS: &str = "ferry_router_autoscale_target_replicas";
pub const AUTOSCALE_MOVES: &str = "ferry_router_autoscale_moves_total";
// Security.
pub const AUTH_FAILURES: &str = "ferry_router_auth_failures_total";

/// Every family the router exports but the connection ones
/// (`ferry_proto::conn::Component::Router.families()`).
pub const ALL: &[Family] = &[
    Family::counter(REQUESTS, "Requests ended, by outcome: ok, cancelled (the client left), invalid, exhausted (no KV room), unavailable (no worker), error."),
    Family::counter(
        GOODPUT_REQUESTS,
        "Requests that finished with every choice within both latency targets (--slo-ttft-ms and --slo-tpot-ms): goodput.",
    ),
    Family::gauge(SLO_TIME_TO_FIRST_TOKEN, "The TTFT target (--slo-ttft-ms) goodput is counted against, in seconds."),
    Family::gauge(SLO_TIME_PER_OUTPUT_TOKEN, "The TPOT target (--slo-tpot-ms) goodput is counted against, in seconds."),
    Family::gauge(INFLIGHT_REQUESTS, "Requests being served now, those waiting in the admission queue included."),
    Family::counter(PROMPT_TOKENS, "Prompt tokens of finished requests, served from a prefix cache (served=cache) or computed (served=computed)."),
    Family::counter(GENERATION_TOKENS, "Tokens generated and sent to clients, counted as they are sent."),
    Family::histogram(
        REQUEST_QUEUE_TIME,
        Buckets::RequestSeconds,
        "Per request, seconds waited in the router's admission queue for KV room before a decode worker first admitted it (0 when admitted at once).",
    ),
    Family::histogram(TIME_TO_FIRST_TOKEN, Buckets::RequestSeconds, "Seconds from a request's arrival to its first token sent, per finished choice."),
    Family::histogram(
        INTER_TOKEN_LATENCY,
        Buckets::TokenSeconds,
        "Seconds between consecutive tokens sent to a client (a delta of k tokens after a gap g counts g/k, k times).",
    ),
    Family::histogram(
        TIME_PER_OUTPUT_TOKEN,
        Buckets::TokenSeconds,
        "Per finished choice of two tokens or more, seconds from its first token to its last over its tokens after the first (TPOT).",
    ),
    Family::histogram(E2E_REQUEST_LATENCY, Buckets::RequestSeconds, "Seconds from a request's arrival to its end, per finished choice."),
    Family::histogram(REQUEST_PROMPT_TOKENS, Buckets::Tokens, "Prompt tokens per finished request."),
    Family::histogram(REQUEST_GENERATION_TOKENS, Buckets::Tokens, "Tokens generated per finished choice."),
    Family::histogram(
        REQUEST_CACHED_PROMPT_TOKENS,
        Buckets::Tokens,
        "Per finished request, prompt tokens served from a worker's prefix cache instead of computed (0 on a miss).",
    ),
    Family::histogram(
        KV_TRANSFER_SECONDS,
        Buckets::TokenSeconds,
        "Per finished request whose KV moved from a prefill to a decode worker, the transfer's seconds as the prefill worker measured them.",
    ),
    Family::histogram(KV_TRANSFER_BYTES, Buckets::Bytes, "Per finished request whose KV moved from a prefill to a decode worker, the bytes moved."),
    Family::histogram(OVERHEAD, Buckets::TokenSeconds, "Per finished choice, seconds of its end-to-end time not spent waiting on workers (the router's own cost)."),
    Family::counter(MIGRATIONS, "Requests moved to another worker after streaming tokens (the stream continues from them)."),
    Family::histogram(
        MIGRATION_STALL,
        Buckets::RequestSeconds,
        "Per migration, the seconds its client saw no token: from the last token before the fault to the first after it.",
    ),
    Family::counter(RETRIES, "Requests started again on other workers before their first token."),
    Family::counter(LOCAL_PREFILLS, "Prompts a decode worker computed itself (it held all but a short suffix in its prefix cache): no KV moved."),
    Family::counter(KV_TRANSFERS, "KV transfers between a prefill and a decode worker, by the transport the router chose and the one the prefill worker used."),
    Family::counter(KV_BYTES, "KV bytes moved between prefill and decode workers, by the transport used."),
    Family::gauge(QUEUE_DEPTH, "Requests waiting in the admission queue for room on a decode worker."),
    Family::counter(QUEUE_REJECTED, "Requests the admission queue refused (429 / RESOURCE_EXHAUSTED), because it was full or they waited too long."),
    Family::gauge(WORKERS, "Registered workers, by role and state (ready, draining, dead)."),
    Family::counter(WORKERS_MARKED_DEAD, "Workers declared dead, by cause: their lease expired or a call to them failed."),
    Family::gauge(WORKER_INFLIGHT_REQUESTS, "Per worker, requests the router has on it now."),
    Family::gauge(WORKER_OUTSTANDING_PREFILL_TOKENS, "Per prefill worker, prompt tokens the router sent it and has no answer for yet."),
    Family::gauge(
        WORKER_QUEUED_PREFILL_TOKENS,
        "Per prefill worker, the prompt tokens ahead of a new prompt: the larger of the router's outstanding count and the worker's report (less what finished since it).",
    ),
    Family::gauge(WORKER_PREFILL_TOKENS_PER_SECOND, "Per prefill worker, its reported prefill rate in tokens per second."),
    Family::gauge(WORKER_ESTIMATED_QUEUE, "Per prefill worker, its queued prompt tokens over its prefill rate, in seconds."),
    Family::gauge(WORKER_KV_BLOCKS_FREE, "Per decode or colocated worker, the free KV blocks it last reported."),
    Family::gauge(WORKER_KV_BLOCKS_CAPACITY, "Per decode or colocated worker, the KV blocks of its pool."),
    Family::gauge(WORKER_PROMISED_KV_BLOCKS, "Per decode or colocated worker, KV blocks promised to admitted requests that its report does not show yet."),
    Family::gauge(
        KV_INDEXED_BLOCKS,
        "Per worker and tier (pool: its KV pool; disk: its --kv-disk tier), the prefix-cache blocks the router's index says it holds there.",
    ),
    Family::gauge(KV_INDEXED_BLOCKS_DISTINCT, "Distinct prefix-cache blocks in the router's index."),
    Family::counter(KV_SNAPSHOTS, "Full prefix-index snapshots applied from workers."),
    Family::counter(KV_RESYNCS, "Heartbeats answered with kv_resync because the worker's cache events had a gap."),
    Family::counter(
        PREFIX_ROUTED,
        "Prefill workers picked, by the tier that holds most of the prompt's cached prefix there as the index tells (pool, disk), or none.",
    ),
    Family::gauge(AUTOSCALE_STEP_TIME_RATIO, "Per role, measured step time over the step time the profile predicts (the autoscaler's calibration)."),
    Family::gauge(AUTOSCALE_OBSERVED_RATE, "Request arrival rate over the autoscaler's window, in requests per second."),
    Family::gauge(AUTOSCALE_OBSERVED_ATTAINMENT, "Share of the window's requests that met the SLO, 0 to 1."),
    Family::gauge(AUTOSCALE_TARGET_REPLICAS, "Per role, the pool size the autoscaler last asked of the scaler."),
    Family::counter(AUTOSCALE_MOVES, "Scale moves the autoscaler made, by role and direction (up, down)."),
    Family::counter(AUTH_FAILURES, "Requests refused for a missing or wrong API key, admin token or cluster secret, by API (grpc, http, admin, cluster)."),
];
