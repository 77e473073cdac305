//! The patterns of `store_statuses` and `store_content_types`: which statuses and media types
//! of an answer the configuration keeps. Parsed here at load; `request::keep` matches answers
//! against them.

use std::fmt;

use crate::http::headers::MediaType;

/// An entry of `store_content_types`: `type/subtype`, `type/*`, `*/*`, or a structured syntax
/// suffix such as `+json` (any `*/*+json`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MediaPattern {
    Exact(MediaType),
    AnySubtype(String),
    Any,
    Suffix(String),
}

impl MediaPattern {
    pub fn parse(s: &str) -> Option<MediaPattern> {
        if s != s.to_ascii_lowercase() || s.contains(';') || s.trim() != s {
            return None;
        }
        if let Some(suffix) = s.strip_prefix('+') {
            let ok = !suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
            return ok.then(|| MediaPattern::Suffix(suffix.into()));
        }
        if s == "*/*" {
            return Some(MediaPattern::Any);
        }
        let media = MediaType::parse(s.as_bytes())?;
        match media.subtype.as_str() {
            "*" if media.kind != "*" => Some(MediaPattern::AnySubtype(media.kind)),
            _ if media.kind.contains('*') || media.subtype.contains('*') => None,
            _ => Some(MediaPattern::Exact(media)),
        }
    }

    pub fn matches(&self, media: &MediaType) -> bool {
        match self {
            MediaPattern::Exact(m) => m == media,
            MediaPattern::AnySubtype(kind) => *kind == media.kind,
            MediaPattern::Any => true,
            MediaPattern::Suffix(suffix) => media.subtype.rsplit_once('+').is_some_and(|(_, s)| s == suffix),
        }
    }
}

impl fmt::Display for MediaPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MediaPattern::Exact(m) => write!(f, "{}/{}", m.kind, m.subtype),
            MediaPattern::AnySubtype(kind) => write!(f, "{kind}/*"),
            MediaPattern::Any => f.write_str("*/*"),
            MediaPattern::Suffix(s) => write!(f, "+{s}"),
        }
    }
}

/// `store_statuses`: status classes (`2xx`) and single codes (`404`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusSet {
    /// `classes[n]`: the class `(n + 2)xx`, for 2xx to 5xx.
    classes: [bool; 4],
    codes: Vec<u16>,
}

impl Default for StatusSet {
    fn default() -> Self {
        StatusSet { classes: [true, false, false, false], codes: Vec::new() }
    }
}

impl StatusSet {
    pub fn empty() -> StatusSet {
        StatusSet { classes: [false; 4], codes: Vec::new() }
    }

    /// Adds `2xx`..`5xx` or a code 200..599; false for anything else.
    pub fn add(&mut self, entry: &str) -> bool {
        let b = entry.as_bytes();
        if let [c @ b'2'..=b'5', b'x' | b'X', b'x' | b'X'] = b {
            self.classes[usize::from(c - b'2')] = true;
            return true;
        }
        match entry.parse::<u16>() {
            Ok(code) if (200..=599).contains(&code) && b.len() == 3 => {
                self.codes.push(code);
                true
            }
            _ => false,
        }
    }

    pub fn contains(&self, status: u16) -> bool {
        let class = usize::from(status / 100).wrapping_sub(2);
        self.classes.get(class).copied().unwrap_or(false) || self.codes.contains(&status)
    }

    pub fn is_empty(&self) -> bool {
        !self.classes.iter().any(|c| *c) && self.codes.is_empty()
    }

    /// The entries, as the configuration takes them.
    pub fn entries(&self) -> Vec<String> {
        let classes = (0..4u16).filter(|i| self.classes[usize::from(*i)]).map(|i| format!("{}xx", i + 2));
        classes.chain(self.codes.iter().map(u16::to_string)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_sets() {
        let mut s = StatusSet::empty();
        for bad in ["1xx", "6xx", "199", "600", "2x", "abc", "0404", " 404", "+404"] {
            assert!(!s.add(bad), "{bad}");
        }
        assert!(s.is_empty());
        assert!(s.add("3XX") && s.add("204"));
        assert_eq!(s.entries(), ["3xx", "204"]);
        assert!(s.contains(301) && s.contains(204) && !s.contains(200) && !s.contains(65535));
    }

    #[test]
    fn media_patterns() {
        for (p, shown) in [
            ("application/json", "application/json"),
            ("text/*", "text/*"),
            ("*/*", "*/*"),
            ("+json", "+json"),
            ("+xml", "+xml"),
        ] {
            assert_eq!(MediaPattern::parse(p).map(|p| p.to_string()).as_deref(), Some(shown), "{p}");
        }
        for bad in [
            "",
            "json",
            "Application/JSON",
            "application/json; charset=utf-8",
            "*/json",
            "+",
            "+j son",
            " text/*",
        ] {
            assert_eq!(MediaPattern::parse(bad), None, "{bad:?}");
        }
    }
}
