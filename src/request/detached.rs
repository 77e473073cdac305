//! Detached execution: the filter sends a locked request to the route's cluster itself, as a
//! callout owned by the root context, so that the execution and its commit outlive a client
//! that gives up (Envoy resets a routed upstream request when the client goes away).

use crate::request::problem::LocalResponse;
use crate::store::client::CalloutFault;

/// A request as the filter forwards it: pseudo-headers first, as Envoy's callout expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamCall {
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

/// Headers that describe one hop, not the request: the callout makes its own.
fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "content-length"
            | "http2-settings"
    )
}

/// The request headers to forward, or `None` when one cannot be (a value that is not UTF-8
/// cannot go through the callout API): such a request is routed normally instead.
pub fn forwardable_request(pairs: &[(String, Vec<u8>)]) -> Option<Vec<(String, String)>> {
    let mut out = Vec::with_capacity(pairs.len());
    for (name, value) in pairs {
        if is_hop_by_hop(name) {
            continue;
        }
        out.push((name.clone(), String::from_utf8(value.clone()).ok()?));
    }
    Some(out)
}

/// Sets `name` to `value` in a header list, replacing every earlier value.
pub fn set_header(headers: &mut Vec<(String, String)>, name: &str, value: &str) {
    headers.retain(|(n, _)| n != name);
    headers.push((name.to_string(), value.to_string()));
}

/// The upstream's answer to a detached call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamAnswer {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// A gRPC answer's trailers (empty for most HTTP answers).
    pub trailers: Vec<(String, Vec<u8>)>,
}

impl UpstreamAnswer {
    /// A callout answer. Envoy answers a callout itself when the upstream does not: `504` for
    /// the timeout, `503` for a reset or refused connection; only an answer that went through
    /// the upstream carries `x-envoy-upstream-service-time`, which tells them apart from the
    /// upstream's own 503 and 504. No headers at all is a reset too. Envoy's `503` says why in
    /// its body (measured with Envoy 1.40: `... reset reason: remote connection failure, ...`,
    /// `... connection timeout`, against `... connection termination` for a reset after the
    /// request went out): a connection never made is [`CalloutFault::Refused`].
    pub fn decode(headers: Vec<(String, Vec<u8>)>, body: Vec<u8>) -> Result<UpstreamAnswer, CalloutFault> {
        if headers.is_empty() {
            return Err(CalloutFault::Reset);
        }
        let status = headers
            .iter()
            .find(|(n, _)| n == ":status")
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u16>().ok())
            .ok_or(CalloutFault::Garbage("no status"))?;
        let from_upstream = headers.iter().any(|(n, _)| n == "x-envoy-upstream-service-time");
        match status {
            504 if !from_upstream => Err(CalloutFault::Timeout),
            503 if !from_upstream => {
                let text = String::from_utf8_lossy(&body);
                let never_sent =
                    ["connection failure", "connection timeout", "overflow", "no healthy upstream"];
                Err(if never_sent.iter().any(|r| text.contains(r)) {
                    CalloutFault::Refused
                } else {
                    CalloutFault::Reset
                })
            }
            _ => Ok(UpstreamAnswer { status, headers, body, trailers: Vec::new() }),
        }
    }

    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
    }

    /// The answer as the client gets it: its own status, headers (less framing, which Envoy
    /// sets for the local response) and body.
    pub fn to_local_response(&self) -> LocalResponse {
        let headers = self
            .headers
            .iter()
            .filter(|(n, _)| !n.starts_with(':') && !is_hop_by_hop(n))
            .filter_map(|(n, v)| Some((n.clone(), String::from_utf8(v.clone()).ok()?)))
            .collect();
        LocalResponse { status: u32::from(self.status), headers, body: self.body.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect()
    }

    #[test]
    fn forwards_everything_but_hop_by_hop_headers() {
        let req = pairs(&[
            (":method", b"POST"),
            (":path", b"/orders?x=1"),
            (":authority", b"shop"),
            ("content-length", b"2"),
            ("connection", b"keep-alive"),
            ("x-request-id", b"abc"),
            ("x-forwarded-for", b"127.0.0.1"),
            ("idempotency-key", b"k1"),
        ]);
        let out = forwardable_request(&req).unwrap();
        let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [":method", ":path", ":authority", "x-request-id", "x-forwarded-for", "idempotency-key"]
        );
        assert_eq!(forwardable_request(&pairs(&[("x-bin", b"\xff")])), None);
        let mut h = out;
        set_header(&mut h, "x-store-key", "aa");
        set_header(&mut h, "x-store-key", "bb");
        assert_eq!(h.iter().filter(|(n, _)| n == "x-store-key").count(), 1);
        assert_eq!(h.last().unwrap().1, "bb");
    }

    #[test]
    fn answers() {
        assert_eq!(UpstreamAnswer::decode(vec![], vec![]), Err(CalloutFault::Reset));
        assert_eq!(UpstreamAnswer::decode(pairs(&[(":status", b"504")]), vec![]), Err(CalloutFault::Timeout));
        assert_eq!(UpstreamAnswer::decode(pairs(&[(":status", b"503")]), vec![]), Err(CalloutFault::Reset));
        // Envoy 1.40's bodies: a connection never made, or one reset after the request went out.
        let envoys =
            |text: &str| UpstreamAnswer::decode(pairs(&[(":status", b"503")]), text.as_bytes().to_vec());
        assert_eq!(
            envoys("upstream connect error or disconnect/reset before headers. reset reason: remote connection failure, transport failure reason: delayed connect error: Connection refused"),
            Err(CalloutFault::Refused)
        );
        assert_eq!(
            envoys(
                "upstream connect error or disconnect/reset before headers. reset reason: connection timeout"
            ),
            Err(CalloutFault::Refused)
        );
        assert_eq!(
            envoys("upstream connect error or disconnect/reset before headers. reset reason: connection termination"),
            Err(CalloutFault::Reset)
        );
        let own = pairs(&[(":status", b"503"), ("x-envoy-upstream-service-time", b"3")]);
        assert_eq!(UpstreamAnswer::decode(own, vec![]).map(|a| a.status), Ok(503), "the upstream's own 503");
        assert!(UpstreamAnswer::decode(pairs(&[("x", b"1")]), vec![]).is_err());
        let a = UpstreamAnswer::decode(
            pairs(&[
                (":status", b"201"),
                ("content-type", b"application/json"),
                ("content-length", b"2"),
                ("set-cookie", b"s=1"),
            ]),
            b"{}".to_vec(),
        )
        .unwrap();
        assert_eq!(a.status, 201);
        let r = a.to_local_response();
        assert_eq!(r.status, 201);
        assert_eq!(r.body, b"{}");
        assert_eq!(
            r.headers,
            vec![("content-type".into(), "application/json".into()), ("set-cookie".into(), "s=1".into())],
            "the client's own answer keeps its cookies; only framing goes"
        );
    }
}
