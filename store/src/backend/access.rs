//! How idemstore reaches Redis beyond its address: TLS (`rediss://`, a CA, a client
//! certificate), the ACL user and its password, and the key prefix. The server and
//! `idemstore records` take the same flags ([`AccessArgs`]) and build the same [`Access`], so a
//! tool reads what the service wrote.
//!
//! The password never comes from argv (a file or `IDEMSTORE_REDIS_PASSWORD`), and nothing here
//! prints it: [`redact`] is how a URL goes into a log line.

use std::path::{Path, PathBuf};

use ::redis::io::tcp::TcpSettings;
use ::redis::{ClientTlsConfig, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, TlsCertificates};

/// The environment variable that may hold the Redis password (rather than a file).
pub const PASSWORD_ENV: &str = "IDEMSTORE_REDIS_PASSWORD";
/// Same for the sentinels' own password.
pub const SENTINEL_PASSWORD_ENV: &str = "IDEMSTORE_REDIS_SENTINEL_PASSWORD";

/// The longest `--key-prefix`: a prefix is a namespace, not data.
const MAX_PREFIX: usize = 64;

/// The Redis access flags, shared by the server and the tools (clap's, with the `clap` feature:
/// idemstore's command line; a host without one fills the fields itself).
#[derive(Debug, Clone, Default)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct AccessArgs {
    /// CA certificates (PEM) that verify Redis's certificate with rediss:// (default: the
    /// system's roots).
    #[cfg_attr(feature = "clap", arg(long, env = "IDEMSTORE_REDIS_CA_FILE", value_name = "PATH"))]
    pub redis_ca_file: Option<PathBuf>,

    /// Client certificate (PEM) for Redis servers that require one (with --redis-key-file).
    #[cfg_attr(
        feature = "clap",
        arg(long, env = "IDEMSTORE_REDIS_CERT_FILE", value_name = "PATH", requires = "redis_key_file")
    )]
    pub redis_cert_file: Option<PathBuf>,

    /// The client certificate's private key (PEM).
    #[cfg_attr(
        feature = "clap",
        arg(long, env = "IDEMSTORE_REDIS_KEY_FILE", value_name = "PATH", requires = "redis_cert_file")
    )]
    pub redis_key_file: Option<PathBuf>,

    /// Accept any certificate from Redis, for any name: for a test setup only (logged as a
    /// warning at start).
    #[cfg_attr(feature = "clap", arg(long, env = "IDEMSTORE_REDIS_TLS_INSECURE"))]
    pub redis_tls_insecure: bool,

    /// The Redis ACL user (instead of the one in the URL).
    #[cfg_attr(feature = "clap", arg(long, env = "IDEMSTORE_REDIS_USERNAME", value_name = "USER"))]
    pub redis_username: Option<String>,

    /// File holding the Redis user's password (trailing line breaks removed); or set
    /// IDEMSTORE_REDIS_PASSWORD. Never on the command line.
    #[cfg_attr(feature = "clap", arg(long, env = "IDEMSTORE_REDIS_PASSWORD_FILE", value_name = "PATH"))]
    pub redis_password_file: Option<PathBuf>,

    /// With --redis-sentinel: the name of the master the sentinels monitor.
    #[cfg_attr(feature = "clap", arg(long, env = "IDEMSTORE_REDIS_SENTINEL_MASTER", value_name = "NAME"))]
    pub redis_sentinel_master: Option<String>,

    /// With --redis-sentinel: the sentinels' own ACL user, if they require one.
    #[cfg_attr(feature = "clap", arg(long, env = "IDEMSTORE_REDIS_SENTINEL_USERNAME", value_name = "USER"))]
    pub redis_sentinel_username: Option<String>,

    /// With --redis-sentinel: file holding the sentinels' own password (their requirepass), if
    /// they require one; or set IDEMSTORE_REDIS_SENTINEL_PASSWORD.
    #[cfg_attr(
        feature = "clap",
        arg(long, env = "IDEMSTORE_REDIS_SENTINEL_PASSWORD_FILE", value_name = "PATH")
    )]
    pub redis_sentinel_password_file: Option<PathBuf>,

    /// Prefix of every Redis key and of the wake-up channel, so that deployments can share a
    /// Redis (e.g. `shop:`). The tools need the same prefix to find the records.
    #[cfg_attr(
        feature = "clap",
        arg(long, env = "IDEMSTORE_KEY_PREFIX", value_name = "PREFIX", default_value = "")
    )]
    pub key_prefix: String,
}

/// What [`AccessArgs`] say, files read and checked: how to open a connection to a node.
#[derive(Clone, Default)]
pub struct Access {
    certificates: Option<TlsCertificates>,
    insecure: bool,
    username: Option<String>,
    password: Option<String>,
    sentinel_username: Option<String>,
    sentinel_password: Option<String>,
    prefix: String,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("tls_files", &self.certificates.is_some())
            .field("insecure", &self.insecure)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Access {
    /// Reads the files the flags name; `env` reads the password variables (the tools pass
    /// their own). Errors name the flag.
    pub fn load(args: &AccessArgs, env: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let root_cert = args.redis_ca_file.as_deref().map(|p| read(p, "--redis-ca-file")).transpose()?;
        let client_tls = match (&args.redis_cert_file, &args.redis_key_file) {
            (Some(cert), Some(key)) => Some(ClientTlsConfig {
                client_cert: read(cert, "--redis-cert-file")?,
                client_key: read(key, "--redis-key-file")?,
            }),
            (None, None) => None,
            _ => return Err("--redis-cert-file and --redis-key-file go together".into()),
        };
        let certificates = (root_cert.is_some() || client_tls.is_some())
            .then_some(TlsCertificates { client_tls, root_cert });
        let password =
            secret(args.redis_password_file.as_deref(), "--redis-password-file", PASSWORD_ENV, &env)?;
        let sentinel_password = secret(
            args.redis_sentinel_password_file.as_deref(),
            "--redis-sentinel-password-file",
            SENTINEL_PASSWORD_ENV,
            &env,
        )?;
        Ok(Self {
            certificates,
            insecure: args.redis_tls_insecure,
            username: args.redis_username.clone(),
            password,
            sentinel_username: args.redis_sentinel_username.clone(),
            sentinel_password,
            prefix: check_prefix(&args.key_prefix)?,
        })
    }

    /// A prefix alone (tests and the defaults).
    pub fn with_prefix(mut self, prefix: &str) -> Result<Self, String> {
        self.prefix = check_prefix(prefix)?;
        Ok(self)
    }

    /// Whether any of it differs from a plain connection (the in-memory backend refuses it).
    pub fn is_given(&self) -> bool {
        self.certificates.is_some()
            || self.insecure
            || self.username.is_some()
            || self.password.is_some()
            || self.sentinel_username.is_some()
            || self.sentinel_password.is_some()
            || !self.prefix.is_empty()
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn insecure(&self) -> bool {
        self.insecure
    }

    /// Whether any TLS file was given (they need a `rediss://` URL).
    pub fn has_tls_files(&self) -> bool {
        self.certificates.is_some()
    }

    pub fn certificates(&self) -> Option<&TlsCertificates> {
        self.certificates.as_ref()
    }

    pub fn username(&self) -> Option<&str> {
        self.username.as_deref()
    }

    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    pub fn sentinel_username(&self) -> Option<&str> {
        self.sentinel_username.as_deref()
    }

    pub fn sentinel_password(&self) -> Option<&str> {
        self.sentinel_password.as_deref()
    }

    /// `url` with the credentials, the TLS choice and `TCP_NODELAY` (records go in one write
    /// and are answered at once: Nagle's algorithm would only add delay). TLS files with a
    /// plain `redis://` URL are refused rather than ignored.
    pub fn connection_info(&self, url: &str) -> Result<ConnectionInfo, String> {
        let info = url.into_connection_info().map_err(|e| e.to_string())?;
        let tls = matches!(info.addr(), ConnectionAddr::TcpTls { .. });
        if !tls && (self.certificates.is_some() || self.insecure) {
            return Err(format!(
                "{}: the TLS flags (--redis-ca-file, --redis-cert-file, --redis-tls-insecure) need a \
                 rediss:// URL",
                redact(url)
            ));
        }
        let mut redis = info.redis_settings().clone();
        if let Some(user) = &self.username {
            redis = redis.set_username(user);
        }
        if let Some(password) = &self.password {
            redis = redis.set_password(password);
        }
        let addr = match info.addr().clone() {
            ConnectionAddr::TcpTls { host, port, insecure, tls_params } => {
                ConnectionAddr::TcpTls { host, port, insecure: insecure || self.insecure, tls_params }
            }
            other => other,
        };
        Ok(info
            .set_addr(addr)
            .set_redis_settings(redis)
            .set_tcp_settings(TcpSettings::default().set_nodelay(true)))
    }

    /// A client of one node at `url`.
    pub fn client(&self, url: &str) -> Result<::redis::Client, String> {
        let info = self.connection_info(url)?;
        match &self.certificates {
            Some(certificates) => ::redis::Client::build_with_tls(info, certificates.clone()),
            None => ::redis::Client::open(info),
        }
        .map_err(|e| e.to_string())
    }
}

fn read(path: &Path, flag: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{flag}: cannot read {}: {e}", path.display()))
}

/// A password from its file (trailing line breaks removed) or else its environment variable.
fn secret(
    file: Option<&Path>,
    flag: &str,
    var: &str,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<Option<String>, String> {
    let value = match file {
        Some(path) => {
            let raw = read(path, flag)?;
            let text =
                String::from_utf8(raw).map_err(|_| format!("{flag}: {} is not UTF-8", path.display()))?;
            text.trim_end_matches(['\r', '\n']).to_owned()
        }
        None => match env(var) {
            Some(value) => value,
            None => return Ok(None),
        },
    };
    if value.is_empty() {
        return Err(format!("{}: the password is empty", file.map_or(var, |_| flag)));
    }
    Ok(Some(value))
}

/// A prefix must not change which Cluster slot a key hashes to (no braces), nor match other
/// keys in a `SCAN` pattern (no glob characters).
fn check_prefix(prefix: &str) -> Result<String, String> {
    if prefix.len() > MAX_PREFIX {
        return Err(format!("--key-prefix: at most {MAX_PREFIX} bytes"));
    }
    if let Some(c) = prefix.chars().find(|c| !c.is_ascii_graphic() || "{}*?[]\\".contains(*c)) {
        return Err(format!(
            "--key-prefix: {c:?} is not allowed (visible ASCII without braces, glob characters or \
             backslash)"
        ));
    }
    Ok(prefix.to_owned())
}

/// The URL without its password, for logs.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            let user = credentials.split_once(':').map_or(credentials, |(user, _)| user);
            let user = if credentials.contains(':') { format!("{user}:***") } else { user.to_owned() };
            format!("{}://{user}@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn redacts_passwords_and_keeps_users() {
        assert_eq!(redact("redis://:secret@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(redact("rediss://idem:secret@h:6380"), "rediss://idem:***@h:6380");
        assert_eq!(redact("rediss://idem@h:6380"), "rediss://idem@h:6380");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
    }

    #[test]
    fn prefixes_that_would_move_keys_are_refused() {
        for bad in ["a{b", "a}", "x*", "?", "a b", "[x]", "a\\b", &"p".repeat(65)] {
            assert!(check_prefix(bad).is_err(), "{bad:?}");
        }
        assert_eq!(check_prefix("shop-1:").unwrap(), "shop-1:");
        assert_eq!(check_prefix("").unwrap(), "");
    }

    #[test]
    fn the_password_comes_from_a_file_or_the_environment() {
        let dir = std::env::temp_dir().join(format!("idem-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "s3cret\n").unwrap();
        let args = AccessArgs { redis_password_file: Some(file.clone()), ..AccessArgs::default() };
        assert_eq!(Access::load(&args, no_env).unwrap().password(), Some("s3cret"));
        let env = |name: &str| (name == PASSWORD_ENV).then(|| "fromenv".to_owned());
        assert_eq!(Access::load(&AccessArgs::default(), env).unwrap().password(), Some("fromenv"));
        // The file wins over the variable.
        assert_eq!(Access::load(&args, env).unwrap().password(), Some("s3cret"));
        std::fs::write(&file, "\n").unwrap();
        assert!(Access::load(&args, no_env).unwrap_err().contains("empty"));
        let missing = AccessArgs { redis_password_file: Some(dir.join("nope")), ..AccessArgs::default() };
        assert!(Access::load(&missing, no_env).unwrap_err().starts_with("--redis-password-file"));
        // Debug never shows it.
        let access = Access::load(&args, env).unwrap_or_default();
        assert!(!format!("{access:?}").contains("fromenv"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn credentials_and_tls_go_into_the_connection() {
        let access =
            Access { username: Some("idem".into()), password: Some("pw".into()), ..Access::default() };
        let info = access.connection_info("rediss://other@h:6380/2").unwrap();
        assert_eq!(info.redis_settings().username(), Some("idem"));
        assert_eq!(info.redis_settings().password(), Some("pw"));
        assert_eq!(info.redis_settings().db(), 2);
        assert!(matches!(info.addr(), ConnectionAddr::TcpTls { insecure: false, .. }));
        let insecure = Access { insecure: true, ..Access::default() };
        assert!(matches!(
            insecure.connection_info("rediss://h:6380").unwrap().addr(),
            ConnectionAddr::TcpTls { insecure: true, .. }
        ));
        // TLS flags with a plain URL: refused, not ignored.
        assert!(insecure.connection_info("redis://h:6379").unwrap_err().contains("rediss://"));
    }
}
