//! The one rule for request ids a client supplies (gRPC `GenerateRequest.request_id`): at most
//! [`MAX_LEN`] bytes of `A-Z a-z 0-9 . _ : -`. Empty means "assign one". An id that breaks the
//! rule is refused before anything else happens (INVALID_ARGUMENT, HTTP 400), never retried, and
//! never written to logs or echoed: the error names the length and the offending byte's
//! position, not the id. The rule keeps ids safe in log lines (no newlines to forge entries with),
//! in gRPC metadata and in the answers' `id` fields.

/// The longest request id accepted, in bytes.
pub const MAX_LEN: usize = 128;

/// Why a request id was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidRequestId {
    #[error("request_id is {len} bytes; at most {MAX_LEN}")]
    TooLong { len: usize },
    #[error("request_id may hold only A-Z a-z 0-9 . _ : - (byte {at} is not one)")]
    BadCharacter { at: usize },
}

/// Whether `b` may appear in a request id.
pub fn allowed(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-')
}

/// Checks a client's request id against the rule (an empty one passes: the router assigns it).
pub fn check(id: &str) -> Result<(), InvalidRequestId> {
    if id.len() > MAX_LEN {
        return Err(InvalidRequestId::TooLong { len: id.len() });
    }
    match id.bytes().position(|b| !allowed(b)) {
        Some(at) => Err(InvalidRequestId::BadCharacter { at }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule() {
        let long = "a".repeat(MAX_LEN + 1);
        let max = "a".repeat(MAX_LEN);
        let cases: &[(&str, Result<(), InvalidRequestId>)] = &[
            ("", Ok(())),
            ("req-42", Ok(())),
            ("chatcmpl_A.b:C-9", Ok(())),
            (&max, Ok(())),
            (&long, Err(InvalidRequestId::TooLong { len: MAX_LEN + 1 })),
            ("a\nINFO forged", Err(InvalidRequestId::BadCharacter { at: 1 })),
            ("a b", Err(InvalidRequestId::BadCharacter { at: 1 })),
            ("é", Err(InvalidRequestId::BadCharacter { at: 0 })),
            ("x/y", Err(InvalidRequestId::BadCharacter { at: 1 })),
        ];
        for (id, want) in cases {
            assert_eq!(check(id), *want, "{id:?}");
        }
        // The message never carries the id itself.
        let e = check("secret\nline").unwrap_err().to_string();
        assert!(!e.contains("secret"), "{e}");
    }
}
