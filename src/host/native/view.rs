//! Envoy's view of the current stream through the module ABI ([`NativeView`], the core's
//! `StreamView`). Every read copies out of Envoy's buffers at once: they are valid only during
//! the hook. A read Envoy refuses is an absent value.

use std::cell::OnceCell;
use std::ptr;

use super::abi::{
    self, AttributeId, EnvoyBuffer, EnvoyHttpHeader, HttpBodyType, HttpHeaderType, ModuleBuffer,
};
use super::env::{random_bytes, NativeEnv};
use crate::request::machine::StreamView;
use crate::worker::env::Clock;

type Pairs = Vec<(String, Vec<u8>)>;

pub struct NativeView {
    filter: abi::HttpFilterEnvoyPtr,
    request: OnceCell<Pairs>,
    response: OnceCell<Pairs>,
}

impl NativeView {
    /// The view of the stream `filter` (null: a view with nothing in it).
    pub fn new(filter: abi::HttpFilterEnvoyPtr) -> Self {
        NativeView { filter, request: OnceCell::new(), response: OnceCell::new() }
    }

    fn headers(&self, kind: HttpHeaderType) -> Pairs {
        if self.filter.is_null() {
            return Vec::new();
        }
        // SAFETY: `filter` is the live stream of the running hook; Envoy fills `size` entries
        // that stay valid until the hook returns, and they are copied before.
        unsafe {
            let size = abi::envoy_dynamic_module_callback_http_get_headers_size(self.filter, kind);
            if size == 0 {
                return Vec::new();
            }
            let mut out = vec![EnvoyHttpHeader::null(); size];
            if !abi::envoy_dynamic_module_callback_http_get_headers(self.filter, kind, out.as_mut_ptr()) {
                return Vec::new();
            }
            out.iter().map(|h| (String::from_utf8_lossy(h.key()).into_owned(), h.value().to_vec())).collect()
        }
    }

    fn header(&self, kind: HttpHeaderType, name: &str) -> Vec<Vec<u8>> {
        if self.filter.is_null() {
            return Vec::new();
        }
        let key = ModuleBuffer::from_str(name);
        let mut values = Vec::new();
        let mut count = 0usize;
        let mut index = 0usize;
        loop {
            let mut out = EnvoyBuffer::null();
            let size = if index == 0 { &mut count as *mut usize } else { ptr::null_mut() };
            // SAFETY: as in `headers`; `key` outlives the call.
            let found = unsafe {
                abi::envoy_dynamic_module_callback_http_get_header(
                    self.filter,
                    kind,
                    key,
                    &mut out,
                    index,
                    size,
                )
            };
            if !found {
                break;
            }
            // SAFETY: Envoy's buffer, valid during the hook, copied now.
            values.push(unsafe { out.as_bytes() }.to_vec());
            index += 1;
            if index >= count {
                break;
            }
        }
        values
    }

    /// The chunks of one body buffer, appended to `out`.
    fn chunks(&self, kind: HttpBodyType, out: &mut Vec<u8>) {
        if self.filter.is_null() {
            return;
        }
        // SAFETY: as in `headers`: the chunks are Envoy's, copied during the hook.
        unsafe {
            let n = abi::envoy_dynamic_module_callback_http_get_body_chunks_size(self.filter, kind);
            if n == 0 {
                return;
            }
            let mut chunks = vec![EnvoyBuffer::null(); n];
            if abi::envoy_dynamic_module_callback_http_get_body_chunks(self.filter, kind, chunks.as_mut_ptr())
            {
                for chunk in &chunks {
                    out.extend_from_slice(chunk.as_bytes());
                }
            }
        }
    }

    /// `len` bytes from `start` of what earlier body hooks left buffered followed by (in a body
    /// hook) the data of this one. A read that starts past the buffered part (the machine reads
    /// only what is new) copies the new data alone.
    fn body(&self, buffered: HttpBodyType, received: HttpBodyType, start: usize, len: usize) -> Vec<u8> {
        let mut body = Vec::new();
        if self.filter.is_null() {
            return body;
        }
        // SAFETY: a size query on the live stream of the running hook.
        let held = unsafe { abi::envoy_dynamic_module_callback_http_get_body_size(self.filter, buffered) };
        let start = if start >= held {
            self.chunks(received, &mut body);
            start - held
        } else {
            self.chunks(buffered, &mut body);
            self.chunks(received, &mut body);
            start
        };
        slice(body, start, len)
    }

    /// The size of the request body so far (buffered and, in a body hook, received).
    pub fn request_body_size(&self) -> usize {
        self.body_size(HttpBodyType::BUFFERED_REQUEST_BODY, HttpBodyType::RECEIVED_REQUEST_BODY)
    }

    pub fn response_body_size(&self) -> usize {
        self.body_size(HttpBodyType::BUFFERED_RESPONSE_BODY, HttpBodyType::RECEIVED_RESPONSE_BODY)
    }

    fn body_size(&self, buffered: HttpBodyType, received: HttpBodyType) -> usize {
        if self.filter.is_null() {
            return 0;
        }
        // SAFETY: a size query on the live stream of the running hook.
        unsafe {
            abi::envoy_dynamic_module_callback_http_get_body_size(self.filter, buffered)
                + abi::envoy_dynamic_module_callback_http_get_body_size(self.filter, received)
        }
    }

    fn string(&self, id: AttributeId) -> Option<Vec<u8>> {
        let mut out = EnvoyBuffer::null();
        // SAFETY: as in `headers`.
        let found = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(self.filter, id, &mut out)
        };
        // SAFETY: Envoy's buffer, valid during the hook, copied now.
        found.then(|| unsafe { out.as_bytes() }.to_vec())
    }

    fn int(&self, id: AttributeId) -> Option<Vec<u8>> {
        let mut out = 0u64;
        // SAFETY: as in `headers`.
        let found = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_get_attribute_int(self.filter, id, &mut out)
        };
        // As proxy-wasm gives an integer property: its 8 little-endian bytes.
        found.then(|| out.to_le_bytes().to_vec())
    }
}

pub enum Kind {
    Text,
    /// Handed to the core as proxy-wasm hands an integer: 8 little-endian bytes.
    Number,
}

/// The Envoy attribute behind a proxy-wasm property path, for the paths the native host reads
/// (the core's own, and those a `subject.property` may name).
pub fn attribute(path: &[&str]) -> Option<(AttributeId, Kind)> {
    use Kind::{Number, Text};
    Some(match path {
        ["xds", "route_name"] => (AttributeId::XDS_ROUTE_NAME, Text),
        ["xds", "cluster_name"] => (AttributeId::XDS_CLUSTER_NAME, Text),
        ["response", "code_details"] => (AttributeId::RESPONSE_CODE_DETAILS, Text),
        ["response", "code"] => (AttributeId::RESPONSE_CODE, Number),
        ["upstream", "request_attempt_count"] => (AttributeId::UPSTREAM_REQUEST_ATTEMPT_COUNT, Number),
        ["upstream", "local_address"] => (AttributeId::UPSTREAM_LOCAL_ADDRESS, Text),
        ["upstream", "address"] => (AttributeId::UPSTREAM_ADDRESS, Text),
        ["source", "address"] => (AttributeId::SOURCE_ADDRESS, Text),
        ["destination", "address"] => (AttributeId::DESTINATION_ADDRESS, Text),
        ["request", "id"] => (AttributeId::REQUEST_ID, Text),
        ["request", "path"] => (AttributeId::REQUEST_PATH, Text),
        ["connection", "requested_server_name"] => (AttributeId::CONNECTION_REQUESTED_SERVER_NAME, Text),
        ["connection", "uri_san_peer_certificate"] => {
            (AttributeId::CONNECTION_URI_SAN_PEER_CERTIFICATE, Text)
        }
        ["connection", "subject_peer_certificate"] => {
            (AttributeId::CONNECTION_SUBJECT_PEER_CERTIFICATE, Text)
        }
        ["connection", "dns_san_peer_certificate"] => {
            (AttributeId::CONNECTION_DNS_SAN_PEER_CERTIFICATE, Text)
        }
        _ => return None,
    })
}

fn slice(body: Vec<u8>, start: usize, len: usize) -> Vec<u8> {
    let end = start.saturating_add(len).min(body.len());
    body.get(start.min(end)..end).map(<[u8]>::to_vec).unwrap_or_default()
}

impl StreamView for NativeView {
    fn now_ms(&self) -> Option<u64> {
        NativeEnv.now_ms()
    }

    fn request_headers(&self) -> Pairs {
        self.request.get_or_init(|| self.headers(HttpHeaderType::REQUEST_HEADER)).clone()
    }

    fn request_header(&self, name: &str) -> Vec<Vec<u8>> {
        self.header(HttpHeaderType::REQUEST_HEADER, name)
    }

    fn response_header(&self, name: &str) -> Vec<Vec<u8>> {
        let pairs = self.response.get_or_init(|| self.headers(HttpHeaderType::RESPONSE_HEADER));
        pairs.iter().filter(|(k, _)| k == name).map(|(_, v)| v.clone()).collect()
    }

    /// The properties the core reads, by their proxy-wasm path ([`attribute`]); others are
    /// absent here.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        if self.filter.is_null() {
            return None;
        }
        match attribute(path)? {
            (id, Kind::Text) => self.string(id),
            (id, Kind::Number) => self.int(id),
        }
    }

    fn request_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        Some(self.body(HttpBodyType::BUFFERED_REQUEST_BODY, HttpBodyType::RECEIVED_REQUEST_BODY, start, len))
    }

    fn response_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        Some(self.body(
            HttpBodyType::BUFFERED_RESPONSE_BODY,
            HttpBodyType::RECEIVED_RESPONSE_BODY,
            start,
            len,
        ))
    }

    fn response_trailers(&self) -> Pairs {
        self.headers(HttpHeaderType::RESPONSE_TRAILER)
    }

    fn random_bytes(&self) -> Option<[u8; 16]> {
        random_bytes()
    }
}
