//! How a transfer's bytes are cut: the largest chunk, the chunks of a layer, a chunk as announced
//! ([`Chunk`]), and how long a step of a transfer may make no progress. Shared by both sides.

use std::ops::Range;
use std::time::Duration;

/// Largest data chunk: well under gRPC's message limit, large enough to amortise per-chunk costs.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// How long one step of a transfer may make no progress before the transfer is failed: a chunk
/// the peer does not take, the next chunk that does not arrive, an acknowledgement that does not
/// come. A frozen peer (stopped, swapping, its network gone without a reset) holds an open
/// connection forever; this bounds what the transfer holds meanwhile (the prefill lease, the
/// decode side's payload buffer).
pub const DEFAULT_STALL: Duration = Duration::from_secs(30);

/// Byte ranges of at most `max` covering `0..len`.
pub fn chunk_ranges(len: usize, max: usize) -> impl Iterator<Item = Range<usize>> {
    let max = max.max(1);
    (0..len.div_ceil(max)).map(move |i| i * max..((i + 1) * max).min(len))
}

/// A piece of the payload body as announced (its bytes are read once the machine takes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub offset: u64,
    pub len: usize,
    /// CRC-32 of a host chunk; the word checksum of a buffer frame.
    pub crc: u32,
    /// A buffer frame: its bytes go into the body buffer, where the pipe delivers.
    pub buffer: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_exactly() {
        let cases = [(0, 4, vec![]), (3, 4, vec![0..3]), (8, 4, vec![0..4, 4..8]), (9, 4, vec![0..4, 4..8, 8..9])];
        for (len, max, want) in cases {
            assert_eq!(chunk_ranges(len, max).collect::<Vec<_>>(), want, "len {len} max {max}");
        }
    }
}
