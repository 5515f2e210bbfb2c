//! Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the
//! matching HTTP status. Router errors keep the status [`RouterError::http_status`] gives them.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::RouterError;
use crate::auth::AuthFailure;

/// One error answer of the HTTP API.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before trying again (the `Retry-After` header of a 429).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(str::to_owned),
            code: None,
            retry_after: None,
        }
    }

    /// 400 `invalid_request_error` for a field named at run time (an unknown one, say).
    pub fn invalid_field(message: impl Into<String>, param: String) -> ApiError {
        ApiError {
            param: Some(param),
            ..ApiError::invalid(message, None)
        }
    }

    /// 401 `authentication_error`.
    pub fn auth(f: AuthFailure) -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: f.message().into(),
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    /// 404 for a model this router does not serve.
    pub fn model_not_found(requested: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{}` does not exist", crate::error::clip(requested)),
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// 500 `server_error`.
    pub fn server(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// An error status that reached the request's event stream.
    pub fn from_status(s: &tonic::Status) -> ApiError {
        ApiError {
            status: crate::error::http_status_of(s.code()),
            message: s.message().to_owned(),
            param: None,
            code: None,
            retry_after: crate::error::retry_after_of(s),
        }
    }

    /// OpenAI's `type` for the status (OpenAI says `invalid_request_error` for an unknown model).
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            429 => "rate_limit_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The `{"error": {...}}` body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl From<RouterError> for ApiError {
    fn from(e: RouterError) -> ApiError {
        // The status is chosen exhaustively by `http_status`; these are only extra hints.
        let (param, code) = match &e {
            RouterError::UnknownModel { .. } => (Some("model"), Some("model_not_found")),
            RouterError::NoWorker { .. } => (None, Some("no_ready_worker")),
            _ => (None, None),
        };
        ApiError {
            status: e.http_status(),
            retry_after: e.retry_after_s(),
            message: e.to_string(),
            param: param.map(str::to_owned),
            code,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(mut self) -> Response {
        // However an error came to echo a client's value, its message stays bounded.
        if let std::borrow::Cow::Owned(cut) = crate::error::clip_to(&self.message, crate::error::MAX_MESSAGE_CHARS) {
            self.message = cut;
        }
        let body = self.body().to_string();
        let mut r = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, s.into());
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::WorkerRole;

    #[test]
    fn router_errors_keep_their_status_and_say_why() {
        let cases = [
            (
                RouterError::InvalidRequest("x".into()),
                400,
                "invalid_request_error",
            ),
            (
                RouterError::UnknownModel {
                    requested: "gpt-17".into(),
                    served: "m".into(),
                },
                404,
                "invalid_request_error",
            ),
            (
                RouterError::NoWorker {
                    role: WorkerRole::Decode,
                },
                503,
                "server_error",
            ),
            (
                RouterError::WorkerFailed {
                    role: WorkerRole::Decode,
                    worker: "d".into(),
                    request_id: "r".into(),
                    code: tonic::Code::InvalidArgument,
                    message: "m".into(),
                },
                400,
                "invalid_request_error",
            ),
            (RouterError::Metrics("m".into()), 500, "server_error"),
            (RouterError::GrammarBusy { waited_ms: 2000, retry_after_s: 1 }, 429, "rate_limit_error"),
        ];
        for (e, status, kind) in cases {
            let a = ApiError::from(e);
            assert_eq!((a.status.as_u16(), a.kind()), (status, kind), "{a:?}");
            assert_eq!(a.body()["error"]["type"], kind);
        }
        let a = ApiError::from(RouterError::UnknownModel {
            requested: "gpt-17".into(),
            served: "m".into(),
        });
        assert_eq!(a.body()["error"]["code"], "model_not_found");
        assert!(a.message.contains("gpt-17"));
        let a = ApiError::auth(AuthFailure::Wrong);
        assert_eq!((a.status.as_u16(), a.kind()), (401, "authentication_error"));
    }
}
