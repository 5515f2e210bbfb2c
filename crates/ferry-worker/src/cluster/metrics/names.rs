//! The worker's metric catalogue (any role: prefill, decode, colocated): every family it exports,
//! as a `const` name used at the call sites, and [`ALL`], the families with their type, buckets
//! and help text (its `# HELP` lines). docs/operations.md ("What to watch") lists the same table.

use ferry_proto::metrics::{Buckets, Family};

// Requests and tokens.
pub const REQUESTS: &str = "ferry_worker_requests_total";
pub const REFUSALS: &str = "ferry_worker_refusals_total";
pub const PROMPT_TOKENS: &str = "ferry_worker_prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "ferry_worker_generation_tokens_total";
pub const REQUEST_QUEUE_TIME: &str = "ferry_worker_request_queue_time_seconds";
pub const PREFILL_SECONDS: &str = "ferry_worker_prefill_seconds";
// The engine.
pub const STEP_SECONDS: &str = "ferry_worker_step_seconds";
pub const DECODE_BATCH_SIZE: &str = "ferry_worker_decode_batch_size";
pub const GRAMMAR_MASK_SECONDS: &str = "ferry_worker_grammar_mask_seconds";
pub const STEP_ISOLATIONS: &str = "ferry_worker_step_isolations_total";
pub const SEQUENCE_FAILURES: &str = "ferry_worker_sequence_failures_total";
pub const DRAINING: &str = "ferry_worker_draining";
pub const ENGINE_FAILED: &str = "ferry_worker_engine_failed";
// Load (refreshed at every scrape).
pub const KV_BLOCKS: &str = "ferry_worker_kv_blocks";
pub const KV_UTILIZATION: &str = "ferry_worker_kv_utilization";
pub const ACTIVE_SEQUENCES: &str = "ferry_worker_active_sequences";
pub const QUEUE_DEPTH: &str = "ferry_worker_queue_depth";
pub const QUEUE_WAITING: &str = "ferry_worker_queue_waiting";
pub const QUEUED_PREFILL_TOKENS: &str = "ferry_worker_queued_prefill_tokens";
pub const QUEUE_OLDEST_SECONDS: &str = "ferry_worker_queue_oldest_seconds";
pub const PREFILL_TOKENS_PER_SECOND: &str = "ferry_worker_prefill_tokens_per_second";
pub const PRICED_STEP_SECONDS: &str = "ferry_worker_priced_step_seconds";
// Speculative decoding.
pub const SPEC_PROPOSED_TOKENS: &str = "ferry_worker_spec_proposed_tokens_total";
pub const SPEC_ACCEPTED_TOKENS: &str = "ferry_worker_spec_accepted_tokens_total";
pub const SPEC_EMITTED_TOKENS: &str = "ferry_worker_spec_emitted_tokens_total";
pub const SPEC_VERIFY_STEPS: &str = "ferry_worker_spec_verify_steps_total";
pub const SPEC_SECONDS: &str = "ferry_worker_spec_seconds";
// The prefix cache.
pub const PREFIX_CACHE_BLOCKS: &str = "ferry_worker_prefix_cache_blocks";
pub const PREFIX_CACHE_QUERIES: &str = "ferry_worker_prefix_cache_queries_total";
pub const PREFIX_CACHE_HITS: &str = "ferry_worker_prefix_cache_hits_total";
pub const PREFIX_CACHE_HIT_BLOCKS: &str = "ferry_worker_prefix_cache_hit_blocks_total";
pub const PREFIX_CACHE_HIT_TOKENS: &str = "ferry_worker_prefix_cache_hit_tokens_total";
pub const PREFIX_CACHE_STORED: &str = "ferry_worker_prefix_cache_stored_total";
pub const PREFIX_CACHE_EVICTIONS: &str = "ferry_worker_prefix_cache_evictions_total";
pub const PREFIX_CACHE_VERIFY_MISSES: &str = "ferry_worker_prefix_cache_verify_misses_total";
pub const PREFIX_CACHE_EVENTS_LOST: &str = "ferry_worker_prefix_cache_events_lost_total";
// The KV disk tier (--kv-disk).
pub const KV_DISK_BLOCKS: &str = "ferry_worker_kv_disk_blocks";
pub const KV_DISK_BYTES: &str = "ferry_worker_kv_disk_bytes";
pub const KV_DISK_CAPACITY: &str = "ferry_worker_kv_disk_capacity_bytes";
pub const KV_DISK_HIT_TOKENS: &str = "ferry_worker_kv_disk_hit_tokens_total";
pub const KV_DISK_WRITTEN_BLOCKS: &str = "ferry_worker_kv_disk_written_blocks_total";
pub const KV_DISK_WRITTEN_BYTES: &str = "ferry_worker_kv_disk_written_bytes_total";
pub const KV_DISK_WRITE_QUEUE: &str = "ferry_worker_kv_disk_write_queue_blocks";
pub const KV_DISK_WRITE_DROPPED: &str = "ferry_worker_kv_disk_write_dropped_total";
pub const KV_DISK_READ_BLOCKS: &str = "ferry_worker_kv_disk_read_blocks_total";
pub const KV_DISK_READ_BYTES: &str = "ferry_worker_kv_disk_read_bytes_total";
pub const KV_DISK_READ_RATE: &str = "ferry_worker_kv_disk_read_tokens_per_second";
pub const KV_DISK_EVICTIONS: &str = "ferry_worker_kv_disk_evictions_total";
pub const KV_DISK_CORRUPT: &str = "ferry_worker_kv_disk_corrupt_total";
// KV transfer.
pub const KV_BYTES_NOT_SHIPPED: &str = "ferry_worker_kv_bytes_not_shipped_total";
pub const KV_TRANSFERS: &str = "ferry_worker_kv_transfers_total";
pub const KV_TRANSFER_BYTES: &str = "ferry_worker_kv_transfer_bytes_total";
pub const KV_TRANSFER_SECONDS: &str = "ferry_worker_kv_transfer_seconds";
pub const KV_TRANSPORT_FALLBACKS: &str = "ferry_worker_kv_transport_fallbacks_total";
pub const KV_STALLS: &str = "ferry_worker_kv_stalls_total";
pub const KV_BUFFER_BYTES: &str = "ferry_worker_kv_buffer_bytes_total";
pub const KV_NCCL_CONNECTS: &str = "ferry_worker_kv_nccl_connects_total";
pub const KV_NCCL_CONNECT_SECONDS: &str = "ferry_worker_kv_nccl_connect_seconds";
pub const KV_NCCL_PIPES: &str = "ferry_worker_kv_nccl_pipes";
pub const KV_NCCL_PIPES_LOST: &str = "ferry_worker_kv_nccl_pipes_lost_total";
// Security.
pub const AUTH_FAILURES: &str = "ferry_worker_auth_failures_total";

/// Every family a worker exports but the connection ones
/// (`ferry_proto::conn::Component::Worker.families()`).
pub const ALL: &[Family] = &[
    Family::counter(REQUESTS, "Requests the worker ended, by role and outcome (ok, error, refused, cancelled)."),
    Family::counter(REFUSALS, "Requests refused at once, by role and reason (queue_full: the prefill queue is at --queue-max)."),
    Family::counter(PROMPT_TOKENS, "Prompt tokens this worker's engine computed, by role (tokens served from its prefix cache are not computed)."),
    Family::counter(
        GENERATION_TOKENS,
        "Tokens this worker's engine sampled, stop tokens excluded, by role (a prefill worker samples each prompt's first token).",
    ),
    Family::histogram(REQUEST_QUEUE_TIME, Buckets::RequestSeconds, "Seconds a prompt waited in the worker's queue before its first chunk was computed, by role."),
    Family::histogram(PREFILL_SECONDS, Buckets::RequestSeconds, "Seconds a prefill worker spent computing one prompt."),
    Family::histogram(STEP_SECONDS, Buckets::TokenSeconds, "Seconds of one engine step (a forward pass over the batch), by role."),
    Family::histogram(DECODE_BATCH_SIZE, Buckets::Batch, "Decoding sequences in one engine step."),
    Family::histogram(
        GRAMMAR_MASK_SECONDS,
        Buckets::TokenSeconds,
        "Seconds to compute one token's structured-output mask, on the engine thread between steps.",
    ),
    Family::counter(STEP_ISOLATIONS, "Engine steps that failed and were re-run sequence by sequence."),
    Family::counter(SEQUENCE_FAILURES, "Sequences ended alone by a failure of their own, the rest of the batch going on."),
    Family::gauge(DRAINING, "1 once the worker is draining to exit, else 0."),
    Family::gauge(ENGINE_FAILED, "1 once the engine failed and the worker is taking itself out (it exits with code 70), else 0."),
    Family::gauge(KV_BLOCKS, "KV cache blocks, by role and state: free, used, reserved (promised to admitted requests)."),
    Family::gauge(KV_UTILIZATION, "KV cache blocks used or promised over all blocks, 0 to 1, by role (the decode pool's autoscaling signal)."),
    Family::gauge(ACTIVE_SEQUENCES, "Sequences the engine holds, by role."),
    Family::gauge(QUEUE_DEPTH, "Requests queued on the worker, by role."),
    Family::gauge(QUEUE_WAITING, "Prompts waiting to start on a prefill worker (bounded by --queue-max)."),
    Family::gauge(QUEUED_PREFILL_TOKENS, "Prompt tokens queued on the worker, by role."),
    Family::gauge(
        QUEUE_OLDEST_SECONDS,
        "Seconds the oldest queued prompt has waited, 0 when none, by role (the prefill pool's autoscaling signal).",
    ),
    Family::gauge(PREFILL_TOKENS_PER_SECOND, "A prefill worker's measured prefill throughput in tokens per second (moving average over steps)."),
    Family::gauge(PRICED_STEP_SECONDS, "Seconds of a priced step, measured (clock=measured) and as the profile predicts (clock=profile), by role."),
    Family::counter(SPEC_PROPOSED_TOKENS, "Draft tokens proposed by speculative decoding."),
    Family::counter(SPEC_ACCEPTED_TOKENS, "Draft tokens the model accepted."),
    Family::counter(SPEC_EMITTED_TOKENS, "Tokens emitted by speculative verify steps."),
    Family::counter(SPEC_VERIFY_STEPS, "Speculative verify steps, per sequence."),
    Family::histogram(
        SPEC_SECONDS,
        Buckets::TokenSeconds,
        "Seconds one engine step spent on speculation outside its forward pass: proposing, learning the acceptance, indexing tokens, rolling back rejected proposals.",
    ),
    Family::gauge(
        PREFIX_CACHE_BLOCKS,
        "Prefix cache blocks, by role and state: cached (free blocks holding a prefix), used (held by sequences), indexed (hashes the routers are told of).",
    ),
    Family::counter(PREFIX_CACHE_QUERIES, "Prefix cache lookups, by role."),
    Family::counter(PREFIX_CACHE_HITS, "Prefix cache lookups that reused blocks, by role."),
    Family::counter(PREFIX_CACHE_HIT_BLOCKS, "KV blocks reused from the prefix cache, by role."),
    Family::counter(PREFIX_CACHE_HIT_TOKENS, "Prompt tokens served from the prefix cache, by role."),
    Family::counter(PREFIX_CACHE_STORED, "Blocks that entered the prefix cache, by role."),
    Family::counter(PREFIX_CACHE_EVICTIONS, "Blocks evicted from the prefix cache, by role."),
    Family::counter(PREFIX_CACHE_VERIFY_MISSES, "Prefix cache lookups stopped by a hash collision or a broken chain, by role."),
    Family::counter(PREFIX_CACHE_EVENTS_LOST, "Prefix cache events the engine dropped before the routers heard of them, by role."),
    Family::gauge(KV_DISK_BLOCKS, "KV blocks held in the disk tier (--kv-disk), by role."),
    Family::gauge(KV_DISK_BYTES, "Bytes of block files in the disk tier, by role."),
    Family::gauge(KV_DISK_CAPACITY, "The most bytes the disk tier keeps (--kv-disk-bytes), by role."),
    Family::counter(KV_DISK_HIT_TOKENS, "Prompt tokens served from the disk tier (read back instead of computed), by role."),
    Family::counter(KV_DISK_WRITTEN_BLOCKS, "Blocks written to the disk tier, by role."),
    Family::counter(KV_DISK_WRITTEN_BYTES, "Bytes written to the disk tier, by role."),
    Family::gauge(KV_DISK_WRITE_QUEUE, "Blocks waiting for the disk tier's writer, by role."),
    Family::counter(KV_DISK_WRITE_DROPPED, "Blocks not written to the disk tier (its queue was full, or the write failed), by role."),
    Family::counter(KV_DISK_READ_BLOCKS, "Blocks read back from the disk tier, by role."),
    Family::counter(KV_DISK_READ_BYTES, "KV bytes read back from the disk tier, by role."),
    Family::gauge(KV_DISK_READ_RATE, "Prompt tokens of KV the disk tier reads and checks per second of reading, as measured (what the routers price a disk hit at), by role."),
    Family::counter(KV_DISK_EVICTIONS, "Blocks evicted from the disk tier to stay within --kv-disk-bytes, by role."),
    Family::counter(KV_DISK_CORRUPT, "Block files that failed their checks (deleted and treated as misses, never served), by role."),
    Family::counter(KV_BYTES_NOT_SHIPPED, "KV bytes a decode worker's prefix cache hit kept off the wire."),
    Family::counter(KV_TRANSFERS, "KV transfers a prefill worker sent, by the transport used."),
    Family::counter(KV_TRANSFER_BYTES, "KV bytes a prefill worker sent, by the transport used."),
    Family::histogram(KV_TRANSFER_SECONDS, Buckets::TokenSeconds, "Seconds of one KV transfer from this prefill worker, by the transport used."),
    Family::counter(KV_TRANSPORT_FALLBACKS, "KV transfers that fell back from one transport to another, by from and to."),
    Family::counter(KV_STALLS, "KV transfers that stalled past the limit, by side (send, receive)."),
    Family::counter(KV_BUFFER_BYTES, "KV bytes moved through device buffers (NCCL or CUDA IPC), by side."),
    Family::counter(KV_NCCL_CONNECTS, "Device pipe rendezvous with a peer, by outcome (ok, error)."),
    Family::histogram(KV_NCCL_CONNECT_SECONDS, Buckets::TokenSeconds, "Seconds to bring a device pipe up with a peer, by transport."),
    Family::gauge(KV_NCCL_PIPES, "Device pipes open now."),
    Family::counter(KV_NCCL_PIPES_LOST, "Device pipes lost (their peer backs off for a while)."),
    Family::counter(AUTH_FAILURES, "Callers refused for a missing or wrong cluster secret, by port (grpc, kv_data)."),
];
