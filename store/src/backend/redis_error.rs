//! What a Redis error means for the backend: a refusal the operator must fix (TLS, credentials,
//! an ACL permission), named as such, or an outage. Its own module because the
//! backend's connection ([`super::redis`]) and the wake-up subscription ([`super::pubsub`]) both
//! read Redis errors, and `redis` uses `pubsub`. Uses the interface's [`BackendError`] and
//! [`super::sentinel`]'s mark of a refusal by the sentinels.

use ::redis::RedisError;

use super::sentinel::SENTINELS_REFUSED;
use super::BackendError;

/// A Redis error as the backend's: a refusal the operator must fix (TLS, credentials, an ACL
/// permission) named as such, anything else an outage.
pub(crate) fn failed(e: RedisError) -> BackendError {
    match refusal(&e) {
        Some(why) => BackendError::Refused(why),
        None => BackendError::Unavailable(e.to_string()),
    }
}

fn refusal(e: &RedisError) -> Option<String> {
    if e.code() == Some("NOPERM") {
        return Some(format!(
            "Redis refused a command to idemstore's ACL user ({e}): grant it the commands, key \
             pattern and channel docs/security.md lists (with --key-prefix, under that prefix)"
        ));
    }
    if login_refused(e) {
        return Some(credentials(e));
    }
    tls_failure(e).map(|tls| {
        format!(
            "TLS with Redis failed: {tls}: check --redis-ca-file (the CA that signed Redis's \
             certificate), that the URL's host is a name or address the certificate holds, and \
             --redis-cert-file/--redis-key-file when Redis requires client certificates"
        )
    })
}

/// Whether `e` is Redis (or a sentinel) refusing the user or password.
pub(crate) fn login_refused(e: &RedisError) -> bool {
    e.kind() == ::redis::ErrorKind::AuthenticationFailed || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"))
}

fn credentials(e: &RedisError) -> String {
    if e.to_string().contains(SENTINELS_REFUSED) {
        return format!("Redis Sentinel refused idemstore's credentials ({e})");
    }
    format!(
        "Redis refused idemstore's credentials ({e}): check the user (--redis-username or the \
         URL's) and its password (--redis-password-file or IDEMSTORE_REDIS_PASSWORD)"
    )
}

/// The TLS error under `e`, if a handshake or certificate check is what failed. The
/// connection manager passes connection errors on as text, so the text is read too.
fn tls_failure(e: &RedisError) -> Option<String> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cause {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(tls) = io.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
                return Some(tls.to_string());
            }
        }
        cause = err.source();
    }
    let text = e.to_string();
    const TLS_MARKS: [&str; 5] = [
        "invalid peer certificate",
        "received fatal alert",
        "peer sent no certificates",
        "peer is incompatible",
        "InvalidCertificate",
    ];
    TLS_MARKS.iter().any(|mark| text.contains(mark)).then_some(text)
}
