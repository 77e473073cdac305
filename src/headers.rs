//! Facts about HTTP header names and values that the config, the record and the replay share.

/// A lower-case RFC 9110 token, not a pseudo-header: the only form Envoy presents header names in.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_lowercase()
                || b.is_ascii_digit()
                || matches!(
                    b,
                    b'!' | b'#'
                        | b'$'
                        | b'%'
                        | b'&'
                        | b'\''
                        | b'*'
                        | b'+'
                        | b'-'
                        | b'.'
                        | b'^'
                        | b'_'
                        | b'`'
                        | b'|'
                        | b'~'
                )
        })
}

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

/// A header value Envoy will accept back in a local reply: visible ASCII, space and tab.
pub fn is_valid_value(value: &[u8]) -> bool {
    value.iter().all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
}

/// `application/json`, or any `+json` type such as `application/problem+json`, with parameters.
pub fn is_json_content_type(value: &[u8]) -> bool {
    let Ok(s) = std::str::from_utf8(value) else {
        return false;
    };
    let essence = s.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind == "application" && (subtype == "json" || subtype.ends_with("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn json_types() {
        assert!(is_json_content_type(b"application/json"));
        assert!(is_json_content_type(b"application/json; charset=utf-8"));
        assert!(is_json_content_type(b"Application/JSON"));
        assert!(is_json_content_type(b"application/problem+json"));
        assert!(!is_json_content_type(b"text/plain"));
        assert!(!is_json_content_type(b"application/jsonx"));
        assert!(!is_json_content_type(b"text/json"));
        assert!(!is_json_content_type(b"\xff"));
        assert!(!is_json_content_type(b""));
    }

    #[test]
    fn values() {
        assert!(is_valid_value(b"/orders/1"));
        assert!(!is_valid_value(b"a\r\nb"));
        assert!(!is_valid_value(b"\x00"));
        assert!(!is_valid_value("é".as_bytes()));
    }
}
