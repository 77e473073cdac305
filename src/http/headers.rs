//! Facts about HTTP header names and values that the config, the record and the replay share.

/// A lower-case RFC 9110 token, not a pseudo-header: the only form Envoy presents header names in.
pub use idem_protocol::is_header_name as is_valid_name;

/// Headers a replay must never carry: another caller's cookies, and hop-by-hop or framing
/// headers that describe the original connection, not the response.
pub fn is_never_replayed(name: &str) -> bool {
    matches!(
        name,
        "set-cookie"
            | "set-cookie2"
            | "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "content-length"
            | "date"
    )
}

/// Headers that say how a response's bytes are read. Every record keeps them, whatever
/// `replay_headers` says: gzip bytes replayed without their `content-encoding` are garbage.
pub const REPRESENTATION: [&str; 3] = ["content-type", "content-encoding", "content-range"];

pub fn is_representation(name: &str) -> bool {
    REPRESENTATION.contains(&name)
}

/// The first content coding of a response's `content-encoding` that a request's
/// `accept-encoding` values do not accept, if any (`identity` is always accepted).
///
/// A request without `accept-encoding` accepts no coding here: RFC 9110 would let a server send
/// any, but a client that sends none (curl without `--compressed`, most simple clients) cannot
/// decode one, and the upstream or Envoy's compressor would have answered it uncoded. A coding
/// is accepted when listed (`x-gzip` is `gzip`) or covered by `*`, with a weight above 0.
pub fn refused_coding(accept: &[Vec<u8>], content_encoding: &[u8]) -> Option<String> {
    let offers: Vec<(String, bool)> = accept
        .iter()
        .flat_map(|v| v.split(|&b| b == b','))
        .filter_map(|item| {
            let item = String::from_utf8_lossy(item);
            let mut parts = item.split(';');
            let coding = canonical_coding(parts.next()?.trim());
            if coding.is_empty() {
                return None;
            }
            let refused = parts.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .or_else(|| p.trim().strip_prefix("Q="))
                    .is_some_and(|q| q.trim().parse::<f32>().is_ok_and(|w| w <= 0.0))
            });
            Some((coding, !refused))
        })
        .collect();
    let accepted = |coding: &str| match offers.iter().find(|(c, _)| c == coding) {
        Some((_, ok)) => *ok,
        None => offers.iter().any(|(c, ok)| c == "*" && *ok),
    };
    String::from_utf8_lossy(content_encoding)
        .split(',')
        .map(|c| canonical_coding(c.trim()))
        .filter(|c| !c.is_empty() && c != "identity")
        .find(|c| !accepted(c))
}

fn canonical_coding(token: &str) -> String {
    let lower = token.to_ascii_lowercase();
    match lower.as_str() {
        "x-gzip" => "gzip".into(),
        "x-compress" => "compress".into(),
        _ => lower,
    }
}

/// A header value Envoy will accept back in a local reply: visible ASCII, space and tab.
pub fn is_valid_value(value: &[u8]) -> bool {
    value.iter().all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
}

/// A media type's essence, lower-cased: `type/subtype` without parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaType {
    pub kind: String,
    pub subtype: String,
}

impl MediaType {
    /// The essence of a `content-type` value, if it has the `type/subtype` form.
    pub fn parse(value: &[u8]) -> Option<MediaType> {
        let s = std::str::from_utf8(value).ok()?;
        let essence = s.split(';').next()?.trim().to_ascii_lowercase();
        let (kind, subtype) = essence.split_once('/')?;
        let token = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
        (token(kind) && token(subtype)).then(|| MediaType { kind: kind.into(), subtype: subtype.into() })
    }

    /// True for the lower-case essence `want` (`"application/cloudevents+json"`).
    pub fn is(&self, want: &str) -> bool {
        want.split_once('/').is_some_and(|(k, s)| k == self.kind && s == self.subtype)
    }
}

/// The latest moment an HTTP date can say (9999-12-31T23:59:59Z); `httpdate` panics past it.
const LAST_HTTP_DATE_MS: u64 = 253_402_300_799_000;

/// `ms` (since the Unix epoch) as an HTTP date (IMF-fixdate, RFC 9110), e.g.
/// `Sat, 05 Dec 2026 17:40:00 GMT`; `None` past what one can say.
pub fn http_date(ms: u64) -> Option<String> {
    if ms > LAST_HTTP_DATE_MS {
        return None;
    }
    let at = std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_millis(ms))?;
    Some(httpdate::fmt_http_date(at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_dates_within_what_one_can_say() {
        assert_eq!(http_date(0).as_deref(), Some("Thu, 01 Jan 1970 00:00:00 GMT"));
        assert_eq!(http_date(1_796_000_000_999).as_deref(), Some("Mon, 30 Nov 2026 00:53:20 GMT"));
        assert_eq!(http_date(LAST_HTTP_DATE_MS).as_deref(), Some("Fri, 31 Dec 9999 23:59:59 GMT"));
        assert_eq!(http_date(LAST_HTTP_DATE_MS + 1), None);
        assert_eq!(http_date(u64::MAX), None);
    }

    #[test]
    fn names() {
        assert!(is_valid_name("location"));
        assert!(is_valid_name("x-request-id"));
        assert!(!is_valid_name("Location"));
        assert!(!is_valid_name(":status"));
        assert!(!is_valid_name("a b"));
        assert!(!is_valid_name(""));
        assert!(is_never_replayed("set-cookie"));
        assert!(!is_never_replayed("location"));
    }

    #[test]
    fn media_types() {
        let m = MediaType::parse(b"Application/Problem+JSON; charset=utf-8").unwrap();
        assert!(m.is("application/problem+json"));
        assert!(!m.is("application/json"));
        assert_eq!(
            MediaType::parse(b" text/plain "),
            Some(MediaType { kind: "text".into(), subtype: "plain".into() })
        );
        for bad in [&b""[..], b"json", b"/json", b"text/", b"a/b/c", b"\xff/x", b"te xt/plain"] {
            assert_eq!(MediaType::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn accepted_codings() {
        let refused = |accept: &[&str], ce: &str| {
            let accept: Vec<Vec<u8>> = accept.iter().map(|a| a.as_bytes().to_vec()).collect();
            refused_coding(&accept, ce.as_bytes())
        };
        assert_eq!(refused(&["gzip, deflate"], "gzip"), None);
        assert_eq!(refused(&["GZIP"], "gzip"), None);
        assert_eq!(refused(&["x-gzip"], "gzip"), None);
        assert_eq!(refused(&["gzip"], "x-gzip"), None);
        assert_eq!(refused(&["br;q=1.0, gzip;q=0.8"], "gzip"), None);
        assert_eq!(refused(&["*"], "br"), None);
        assert_eq!(refused(&["br", "gzip"], "gzip, br"), None, "every header value counts");
        assert_eq!(refused(&[], "gzip"), Some("gzip".into()), "no accept-encoding: no coding");
        assert_eq!(refused(&[""], "gzip"), Some("gzip".into()));
        assert_eq!(refused(&["identity"], "gzip"), Some("gzip".into()));
        assert_eq!(refused(&["br"], "gzip"), Some("gzip".into()));
        assert_eq!(refused(&["gzip;q=0"], "gzip"), Some("gzip".into()));
        assert_eq!(refused(&["gzip;q=0.000, *"], "gzip"), Some("gzip".into()), "listed beats *");
        assert_eq!(refused(&["*;q=0"], "br"), Some("br".into()));
        assert_eq!(refused(&["gzip"], "gzip, br"), Some("br".into()));
        assert_eq!(refused(&[], "identity"), None);
        assert_eq!(refused(&[], ""), None);
    }

    #[test]
    fn values() {
        assert!(is_valid_value(b"/orders/1"));
        assert!(!is_valid_value(b"a\r\nb"));
        assert!(!is_valid_value(b"\x00"));
        assert!(!is_valid_value("é".as_bytes()));
    }
}
