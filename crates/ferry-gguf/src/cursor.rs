//! A bounds-checked little-endian reader over a byte slice. Every read checks the bytes left
//! first, and [`Cursor::count`] checks that a count read from the file could fit in them, so no
//! length taken from the file is ever allocated before it is known to be backed by real bytes.

use crate::GgufError;

pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Cursor { bytes, pos: 0 }
    }

    pub(crate) fn offset(&self) -> u64 {
        self.pos as u64
    }

    pub(crate) fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    /// The next `n` bytes; `what` names the item for the error message.
    pub(crate) fn take(
        &mut self,
        n: u64,
        what: impl FnOnce() -> String,
    ) -> Result<&'a [u8], GgufError> {
        let available = self.remaining();
        if n > available {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.offset(),
                needed: n,
                available,
            });
        }
        // n <= remaining, which is a usize, so the conversion and addition cannot overflow.
        let end = self.pos + n as usize;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(
        &mut self,
        what: impl FnOnce() -> String,
    ) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: impl FnOnce() -> String) -> Result<u8, GgufError> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn u16(&mut self, what: impl FnOnce() -> String) -> Result<u16, GgufError> {
        self.array(what).map(u16::from_le_bytes)
    }

    pub(crate) fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A `u64` count of items, each at least `min_item_bytes` long, checked against the bytes left.
    pub(crate) fn count(
        &mut self,
        min_item_bytes: u64,
        what: impl Fn() -> String,
    ) -> Result<usize, GgufError> {
        let offset = self.offset();
        let n = self.u64(|| format!("count of {}", what()))?;
        let available = self.remaining();
        let fits = n
            .checked_mul(min_item_bytes)
            .is_some_and(|b| b <= available);
        match usize::try_from(n) {
            Ok(n) if fits => Ok(n),
            _ => Err(GgufError::TooLarge {
                what: format!("count of {}", what()),
                offset,
                n,
                available,
            }),
        }
    }

    /// A GGUF string: `u64` byte length, then that many bytes of UTF-8.
    pub(crate) fn string(&mut self, what: impl Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(|| format!("length of {}", what()))?;
        let offset = self.offset();
        let bytes = self.take(len, &what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 {
                what: what(),
                offset,
            }),
        }
    }
}
