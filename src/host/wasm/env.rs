//! Envoy as the pure core reads it: the current stream's headers, properties and bodies
//! ([`HostView`], a `StreamView`), and the clock and the shared data ([`HostEnv`], the worker's
//! `Env`). Every read is a `hostcalls::` function that returns `Result`; a failed read is an
//! absent value, never a panic.

use proxy_wasm::hostcalls;

use super::abi;
use proxy_wasm::types::{BufferType, MapType};
use std::cell::OnceCell;

use crate::request::machine::StreamView;
use crate::worker::env::{Clock, SharedData};

pub struct HostEnv;

impl Clock for HostEnv {
    fn now_us(&self) -> Option<u64> {
        let t = hostcalls::get_current_time().ok()?;
        let us = t.duration_since(std::time::UNIX_EPOCH).ok()?.as_micros();
        u64::try_from(us).ok()
    }
}

impl SharedData for HostEnv {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(value), Some(cas))) => Some((value, cas)),
            _ => None,
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        hostcalls::set_shared_data(key, Some(value), Some(cas)).is_ok()
    }
}

/// Envoy's view of the current stream, read on demand; header maps are fetched once per callback.
#[derive(Default)]
pub struct HostView {
    request: OnceCell<Vec<(String, Vec<u8>)>>,
    response: OnceCell<Vec<(String, Vec<u8>)>>,
}

/// Headers Envoy holds one value of (pseudo-headers, and the request id it sets itself), or whose
/// first value is all the filter needs (`content-length`: Envoy refuses differing copies).
const SINGLE_VALUED: [&str; 4] = [":method", ":path", "content-length", "x-request-id"];

fn values(pairs: &[(String, Vec<u8>)], name: &str) -> Vec<Vec<u8>> {
    pairs.iter().filter(|(k, _)| k == name).map(|(_, v)| v.clone()).collect()
}

fn header_map(cell: &OnceCell<Vec<(String, Vec<u8>)>>, map: MapType) -> &[(String, Vec<u8>)] {
    cell.get_or_init(|| abi::get_map_bytes(map).unwrap_or_default())
}

impl StreamView for HostView {
    fn now_ms(&self) -> Option<u64> {
        HostEnv.now_ms()
    }
    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        header_map(&self.request, MapType::HttpRequestHeaders).to_vec()
    }

    fn request_header(&self, name: &str) -> Vec<Vec<u8>> {
        if let Some(pairs) = self.request.get() {
            return values(pairs, name);
        }
        // One value lookup instead of copying the whole header map into the VM: most requests
        // are decided (method not guarded, no key) with two of them. Envoy's lookup returns the
        // first value only, so a header that is present and may repeat (`idempotency-key`:
        // two of them are a 400) is read from the whole map.
        match abi::get_map_value_bytes(MapType::HttpRequestHeaders, name) {
            Ok(None) => Vec::new(),
            Ok(Some(v)) if SINGLE_VALUED.contains(&name) => vec![v],
            _ => values(header_map(&self.request, MapType::HttpRequestHeaders), name),
        }
    }

    fn response_header(&self, name: &str) -> Vec<Vec<u8>> {
        values(header_map(&self.response, MapType::HttpResponseHeaders), name)
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        abi::get_property(path).ok().flatten()
    }

    fn request_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        abi::get_buffer(BufferType::HttpRequestBody, start, len).ok().map(Option::unwrap_or_default)
    }

    fn response_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        abi::get_buffer(BufferType::HttpResponseBody, start, len).ok().map(Option::unwrap_or_default)
    }

    fn response_trailers(&self) -> Vec<(String, Vec<u8>)> {
        abi::get_map_bytes(MapType::HttpResponseTrailers).unwrap_or_default()
    }

    fn random_bytes(&self) -> Option<[u8; 16]> {
        let mut buf = [0u8; 16];
        // SAFETY: `random_get` writes exactly `buf.len()` bytes into `buf`, which outlives the
        // call; Envoy implements it over its own random source (std's `RandomState` relies on
        // it too).
        let errno = unsafe { wasi::random_get(buf.as_mut_ptr(), buf.len()) };
        (errno == 0).then_some(buf)
    }
}

/// WASI's random source, which std does not expose.
mod wasi {
    #[link(wasm_import_module = "wasi_snapshot_preview1")]
    extern "C" {
        /// Fills `buf` with `len` random bytes; 0 on success, else a WASI errno.
        pub fn random_get(buf: *mut u8, len: usize) -> u16;
    }
}
