//! The proxy-wasm calls a stream's callbacks make (and the store stream's sends), without the
//! SDK's panics.
//!
//! `proxy_wasm::hostcalls` returns `Result`, but panics on any status it does not expect (for
//! `set_map_value`, anything but `Ok`), and a panic traps the VM. Envoy does answer such
//! statuses: replacing a request header after the headers have gone on (`pause_on_headers:
//! false`) is `NotFound` (found by the gRPC replay under Istio's shape). So these calls go to
//! the host directly and every status other than `Ok` is an `Err` the caller handles.
//! Returned memory is allocated by the host through the SDK's `proxy_on_memory_allocate`
//! (a `Vec` with capacity equal to its length), and taken back the way the SDK does.

use proxy_wasm::types::{BufferType, MapType};
use std::ptr::{null, null_mut};

use crate::host::calls::Status;

type Bytes = Vec<u8>;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_pairs(map_type: u32, data: *mut *mut u8, size: *mut usize) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key: *const u8,
        key_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key: *const u8, key_size: usize) -> u32;
    fn proxy_add_header_map_value(
        map_type: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: u32,
        start: usize,
        size: usize,
        data: *const u8,
        data_size: usize,
    ) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_call_foreign_function(
        name: *const u8,
        name_size: usize,
        args: *const u8,
        args_size: usize,
        results: *mut *mut u8,
        results_size: *mut usize,
    ) -> u32;
    fn proxy_get_property(path: *const u8, path_size: usize, data: *mut *mut u8, size: *mut usize) -> u32;
    fn proxy_set_property(path: *const u8, path_size: usize, value: *const u8, value_size: usize) -> u32;
    fn proxy_grpc_send(token: u32, message: *const u8, message_size: usize, end_stream: bool) -> u32;
    fn proxy_grpc_cancel(token: u32) -> u32;
}

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
/// `proxy_continue_stream`'s stream type for the request.
const HTTP_REQUEST: u32 = 0;

fn ok(status: u32) -> Result<(), Status> {
    if status == OK {
        Ok(())
    } else {
        Err(Status(status))
    }
}

/// Takes ownership of memory the host allocated for a returned value.
///
/// # Safety
/// `data` is null or was allocated by the SDK's allocator for exactly `size` bytes, and is not
/// used after this.
unsafe fn owned(data: *mut u8, size: usize) -> Bytes {
    if data.is_null() {
        Vec::new()
    } else {
        // SAFETY: the allocator hands out `Vec`s of capacity `size`, forgotten; taken back once.
        unsafe { Vec::from_raw_parts(data, size, size) }
    }
}

/// A value call: `Ok(None)` for `NotFound`.
fn fetch(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> Result<Option<Bytes>, Status> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    match call(&mut data, &mut size) {
        // SAFETY: on `Ok` the host wrote a fresh allocation (or null) and its size.
        OK => Ok(Some(unsafe { owned(data, size) })),
        NOT_FOUND => Ok(None),
        s => Err(Status(s)),
    }
}

pub fn get_map_bytes(map: MapType) -> Result<Vec<(String, Bytes)>, Status> {
    // SAFETY: the pointers are valid for the call; the host writes through them only.
    let bytes = fetch(|d, s| unsafe { proxy_get_header_map_pairs(map as u32, d, s) })?;
    decode_map(&bytes.unwrap_or_default()).ok_or(Status(u32::MAX))
}

pub fn get_map_value_bytes(map: MapType, name: &str) -> Result<Option<Bytes>, Status> {
    // SAFETY: as above; `name` outlives the call.
    fetch(|d, s| unsafe { proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), d, s) })
}

/// Replaces every value of `name` (or removes them, `None`).
pub fn set_map_value(map: MapType, name: &str, value: Option<&str>) -> Result<(), Status> {
    // SAFETY: the slices outlive the calls; the host only reads them.
    ok(unsafe {
        match value {
            Some(v) => {
                proxy_replace_header_map_value(map as u32, name.as_ptr(), name.len(), v.as_ptr(), v.len())
            }
            None => proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()),
        }
    })
}

pub fn add_map_value(map: MapType, name: &str, value: &str) -> Result<(), Status> {
    // SAFETY: as above.
    ok(unsafe {
        proxy_add_header_map_value(map as u32, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

pub fn get_buffer(buffer: BufferType, start: usize, max: usize) -> Result<Option<Bytes>, Status> {
    // SAFETY: as for `fetch`.
    fetch(|d, s| unsafe { proxy_get_buffer_bytes(buffer as u32, start, max, d, s) })
}

/// Replaces `size` bytes from `start` with `value` (Envoy: from 0, the whole of `size`).
pub fn set_buffer(buffer: BufferType, start: usize, size: usize, value: &[u8]) -> Result<(), Status> {
    // SAFETY: `value` outlives the call.
    ok(unsafe { proxy_set_buffer_bytes(buffer as u32, start, size, value.as_ptr(), value.len()) })
}

pub fn send_http_response(
    status: u32,
    headers: &[(String, String)],
    body: Option<&[u8]>,
) -> Result<(), Status> {
    let headers = encode_map(headers);
    let (body, body_size) = body.map_or((null(), 0), |b| (b.as_ptr(), b.len()));
    // SAFETY: every slice outlives the call. -1: no gRPC status of the filter's own.
    ok(unsafe {
        proxy_send_local_response(status, null(), 0, body, body_size, headers.as_ptr(), headers.len(), -1)
    })
}

pub fn resume_http_request() -> Result<(), Status> {
    // SAFETY: no memory is passed.
    ok(unsafe { proxy_continue_stream(HTTP_REQUEST) })
}

pub fn set_effective_context(id: u32) -> Result<(), Status> {
    // SAFETY: no memory is passed.
    ok(unsafe { proxy_set_effective_context(id) })
}

/// A foreign function without arguments whose results are not needed.
pub fn call_foreign_function(name: &str) -> Result<(), Status> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: `name` outlives the call; results are taken back and dropped.
    let status =
        unsafe { proxy_call_foreign_function(name.as_ptr(), name.len(), null(), 0, &mut data, &mut size) };
    if status == OK {
        // SAFETY: on `Ok` the host wrote a fresh allocation (or null) and its size.
        drop(unsafe { owned(data, size) });
    }
    ok(status)
}

/// `Ok(None)` for a property that is absent or has no value (as the SDK's).
pub fn get_property(path: &[&str]) -> Result<Option<Bytes>, Status> {
    let path = path.join("\0");
    // SAFETY: as for `fetch`.
    let value = fetch(|d, s| unsafe { proxy_get_property(path.as_ptr(), path.len(), d, s) })?;
    Ok(value.filter(|v| !v.is_empty()))
}

pub fn set_property(path: &[&str], value: &[u8]) -> Result<(), Status> {
    let path = path.join("\0");
    // SAFETY: both slices outlive the call.
    ok(unsafe { proxy_set_property(path.as_ptr(), path.len(), value.as_ptr(), value.len()) })
}

/// A message on an open gRPC stream (the stream's context must be the effective one).
pub fn grpc_send(token: u32, message: &[u8]) -> Result<(), Status> {
    // SAFETY: `message` outlives the call; the host only reads it.
    ok(unsafe { proxy_grpc_send(token, message.as_ptr(), message.len(), false) })
}

/// Resets a gRPC stream; no callback of it follows.
pub fn grpc_cancel(token: u32) -> Result<(), Status> {
    // SAFETY: no memory is passed.
    ok(unsafe { proxy_grpc_cancel(token) })
}

/// proxy-wasm's map encoding: the pair count, each pair's key and value sizes (u32, little
/// endian), then each key and value followed by a NUL.
fn encode_map(map: &[(String, String)]) -> Bytes {
    let size = 4 + map.iter().map(|(n, v)| n.len() + v.len() + 10).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(map.len() as u32).to_le_bytes());
    for (n, v) in map {
        out.extend_from_slice(&(n.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (n, v) in map {
        out.extend_from_slice(n.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// The reverse of [`encode_map`], keeping values as bytes; `None` for a malformed map.
fn decode_map(bytes: &[u8]) -> Option<Vec<(String, Bytes)>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let u32_at = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let count = u32_at(0)?;
    let mut data = count.checked_mul(8)?.checked_add(4)?;
    let mut out = Vec::with_capacity(count.min(1024));
    for i in 0..count {
        let key_size = u32_at(4 + i * 8)?;
        let value_size = u32_at(8 + i * 8)?;
        let key = bytes.get(data..data.checked_add(key_size)?)?;
        data = data.checked_add(key_size + 1)?;
        let value = bytes.get(data..data.checked_add(value_size)?)?;
        data = data.checked_add(value_size + 1)?;
        out.push((String::from_utf8(key.to_vec()).ok()?, value.to_vec()));
    }
    Some(out)
}
