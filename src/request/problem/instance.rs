//! A problem's `instance` (RFC 9457): the URI of this one occurrence, which the filter's log
//! line and the access log (filter state `wasm.idempotency_instance`) carry too, so that the
//! problem a client pastes into a ticket leads to the request.
//!
//! `urn:uuid:` and a version-4 UUID of its own, not the request's `x-request-id`: a client may
//! send that header (Envoy keeps it when the request is internal, or with
//! `preserve_external_request_id`), and a client that repeats it on a retry would get one
//! `instance` for two occurrences, or put whatever it likes in a URI. The UUID is SHA-256 of the
//! VM's random seed and a count: unique across VMs without a host call per problem, and it says
//! nothing of how many came before.

use sha2::{Digest, Sha256};

/// The filter state (`wasm.` + this) that holds a refused request's `instance`.
pub const INSTANCE_PROPERTY: &str = "idempotency_instance";

/// The instances one VM hands out.
#[derive(Debug, Default)]
pub struct Instances {
    seed: u64,
    count: u64,
}

impl Instances {
    pub fn new(seed: u64) -> Instances {
        Instances { seed, count: 0 }
    }

    pub fn mint(&mut self) -> String {
        self.count = self.count.wrapping_add(1);
        let digest = Sha256::new()
            .chain_update(self.seed.to_be_bytes())
            .chain_update(self.count.to_be_bytes())
            .finalize();
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        uuid_urn(bytes)
    }
}

/// `urn:uuid:` and `bytes` as a version-4 (random) UUID, RFC 9562.
fn uuid_urn(mut bytes: [u8; 16]) -> String {
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("urn:uuid:{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn is_uuid_v4_urn(s: &str) -> bool {
        let Some(uuid) = s.strip_prefix("urn:uuid:") else { return false };
        let groups: Vec<&str> = uuid.split('-').collect();
        groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
            && uuid.bytes().all(|b| b == b'-' || b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            && groups[2].starts_with('4')
            && matches!(groups[3].as_bytes()[0], b'8' | b'9' | b'a' | b'b')
    }

    #[test]
    fn instances_are_distinct_v4_uuids_per_seed_and_count() {
        let mut seen = HashSet::new();
        for seed in [0, 1, u64::MAX] {
            let mut instances = Instances::new(seed);
            for _ in 0..1000 {
                let i = instances.mint();
                assert!(is_uuid_v4_urn(&i), "{i}");
                assert!(seen.insert(i));
            }
        }
    }
}
