//! A plain HTTP/1.1 client over loopback for the OpenAI API tests (hyper's connection API, one
//! connection per request), with server-sent events split into their `data:` payloads.

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use serde_json::Value;

pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub retry_after: Option<String>,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// Checks OpenAI's error shape and returns the `error` object.
    pub fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", self.body);
        assert_eq!(self.content_type, "application/json", "{}", self.body);
        let v = self.json();
        let e = v["error"].clone();
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.as_object().unwrap().contains_key("param"), "{v}");
        assert!(e.as_object().unwrap().contains_key("code"), "{v}");
        e
    }
}

/// An open response whose body is read as it arrives; dropping it closes the connection.
pub struct Open {
    pub status: u16,
    pub content_type: String,
    pub retry_after: Option<String>,
    body: Incoming,
    conn: tokio::task::JoinHandle<()>,
    buf: String,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.conn.abort();
    }
}

impl Open {
    /// The next server-sent event's data, or `None` at the end of the body.
    pub async fn event(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.find("\n\n") {
                let ev: String = self.buf.drain(..i + 2).collect();
                let data = ev
                    .trim_end()
                    .strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not an SSE data line: {ev:?}"));
                return Some(data.to_owned());
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.push_str(std::str::from_utf8(&d).expect("UTF-8"));
                    }
                }
                Some(Err(e)) => panic!("reading the body: {e}"),
                None => {
                    assert!(
                        self.buf.is_empty(),
                        "a partial event at the end: {:?}",
                        self.buf
                    );
                    return None;
                }
            }
        }
    }

    /// Every remaining event.
    pub async fn events(mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(e) = self.event().await {
            out.push(e);
        }
        out
    }

    pub async fn text(mut self) -> String {
        let mut out = std::mem::take(&mut self.buf);
        while let Some(Ok(f)) = self.body.frame().await {
            if let Ok(d) = f.into_data() {
                out.push_str(std::str::from_utf8(&d).expect("UTF-8"));
            }
        }
        out
    }
}

/// Sends one request to `addr` (host:port) and returns the open response.
pub async fn open(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&str>,
) -> Open {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the HTTP API");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("HTTP handshake");
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr);
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or("").to_owned())))
        .unwrap();
    let resp = sender.send_request(req).await.expect("HTTP request");
    let content_type = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let retry_after = resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
    Open {
        status: resp.status().as_u16(),
        content_type,
        retry_after,
        body: resp.into_body(),
        conn,
        buf: String::new(),
    }
}

pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&str>,
) -> Answer {
    let o = open(addr, method, path, key, body).await;
    let (status, content_type, retry_after) = (o.status, o.content_type.clone(), o.retry_after.clone());
    Answer {
        status,
        content_type,
        retry_after,
        body: o.text().await,
    }
}

pub async fn post(addr: &str, path: &str, body: &str) -> Answer {
    request(addr, "POST", path, None, Some(body)).await
}

pub async fn get(addr: &str, path: &str) -> Answer {
    request(addr, "GET", path, None, None).await
}
