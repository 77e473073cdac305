//! How a configuration key is declared and checked: [`raw_keys!`] declares the keys of a JSON
//! object as written, [`config!`] declares the whole configuration from one table (each simple
//! number or boolean key one row: name, type, default and range, from which its field, its
//! check and its place in `to_raw` follow), and the checks every key shares. Every error names
//! the key and, for numbers, the allowed range, because that message is all an operator sees in
//! Envoy's log when the filter is refused.

use serde::{Deserialize, Deserializer};
use serde_json::Value;
use std::fmt;
use std::ops::RangeInclusive;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "invalid configuration: {}", self.message)
        } else {
            write!(f, "invalid configuration: `{}` {}", self.key, self.message)
        }
    }
}

pub fn err(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError { key: key.to_string(), message: message.into() }
}

/// A key's value as written, JSON `null` included (`None`: the key is absent), so that every
/// key decides for itself whether `null` means "not set" or is refused.
pub fn given<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// Declares the keys of a configuration object: each one a field holding its JSON value, any
/// other key refused by serde (`deny_unknown_fields`). The values are checked by
/// `Config::validate`, whose errors name the key and its range.
macro_rules! raw_keys {
    ($(#[$meta:meta])* $name:ident { $($(#[$doc:meta])* $key:ident,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            $(
                $(#[$doc])*
                #[serde(default, deserialize_with = "crate::config::keys::given", skip_serializing_if = "Option::is_none")]
                pub $key: Option<serde_json::Value>,
            )*
        }
    };
}
pub(crate) use raw_keys;

/// Declares the configuration from its table: `numbers` and `flags` are the simple keys, one row
/// each (`name: type = default, range;` and `name = default;`), whose field in [`Config`], check
/// and `to_raw` entry follow from the row; `structured` are the keys whose values are checked by
/// hand (`Config::validate` builds them into `Structured`, `Config::structured_to_raw` writes
/// them back); `raw_only` are keys that are read but are not fields of their own. Also builds
/// [`SIMPLE_KEYS`] and [`KEYS`], which the docs test reads.
///
/// [`Config`]: crate::config::Config
/// [`SIMPLE_KEYS`]: crate::config::SIMPLE_KEYS
/// [`KEYS`]: crate::config::KEYS
macro_rules! config {
    (
        numbers { $( $(#[$ndoc:meta])* $num:ident: $nty:ty = $ndef:expr, $nrange:expr; )* }
        flags { $( $(#[$fdoc:meta])* $flag:ident = $fdef:expr; )* }
        structured { $( $(#[$sdoc:meta])* $field:ident: $sty:ty, )* }
        raw_only { $( $(#[$rdoc:meta])* $raw:ident, )* }
    ) => {
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct Config {
            $( $(#[$ndoc])* pub $num: $nty, )*
            $( $(#[$fdoc])* pub $flag: bool, )*
            $( $(#[$sdoc])* pub $field: $sty, )*
        }

        /// The simple keys' values, checked (some structured keys' checks depend on them).
        struct Simple {
            $( $num: $nty, )*
            $( $flag: bool, )*
        }

        /// The structured keys' values, checked.
        struct Structured {
            $( $field: $sty, )*
        }

        $crate::config::keys::raw_keys! {
            /// The plugin configuration as written: every key it may have (docs/configuration.md
            /// documents each).
            RawConfig {
                $( $num, )*
                $( $flag, )*
                $( $field, )*
                $( $(#[$rdoc])* $raw, )*
            }
        }

        /// The simple keys: name, default and range, as the docs must show them.
        pub const SIMPLE_KEYS: &[$crate::config::keys::SimpleKey] = &[
            $( $crate::config::keys::SimpleKey {
                name: stringify!($num),
                default: $crate::config::keys::Default::Number($ndef),
                range: Some($nrange),
            }, )*
            $( $crate::config::keys::SimpleKey {
                name: stringify!($flag),
                default: $crate::config::keys::Default::Flag($fdef),
                range: None,
            }, )*
        ];

        /// Every top-level key.
        pub const KEYS: &[&str] = &[
            $( stringify!($num), )* $( stringify!($flag), )* $( stringify!($field), )* $( stringify!($raw), )*
        ];

        impl Simple {
            fn check(raw: &mut RawConfig) -> Result<Simple, ConfigError> {
                Ok(Simple {
                    // Each range fits its type: checked by the config tests.
                    $( $num: $crate::config::keys::number(raw.$num.take(), stringify!($num), $nrange, $ndef)? as $nty, )*
                    $( $flag: $crate::config::keys::boolean(raw.$flag.take(), stringify!($flag), $fdef)?, )*
                })
            }
        }

        impl Config {
            fn assemble(simple: Simple, structured: Structured) -> Config {
                Config {
                    $( $num: simple.$num, )*
                    $( $flag: simple.$flag, )*
                    $( $field: structured.$field, )*
                }
            }

            /// The configuration as an operator would write it, every key explicit: what
            /// [`Config::validate`] takes back as the same configuration (the config fuzz target
            /// checks it).
            pub fn to_raw(&self) -> RawConfig {
                let mut raw = self.structured_to_raw();
                $( raw.$num = Some(serde_json::json!(self.$num)); )*
                $( raw.$flag = Some(serde_json::json!(self.$flag)); )*
                raw
            }
        }
    };
}
pub(crate) use config;

/// A simple key's row of the table, for the docs test.
#[derive(Debug)]
pub struct SimpleKey {
    pub name: &'static str,
    pub default: Default,
    /// A number's allowed values.
    pub range: Option<RangeInclusive<u64>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Default {
    Number(u64),
    Flag(bool),
}

/// As docs/configuration.md shows it.
impl fmt::Display for Default {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Default::Number(n) => write!(f, "{n}"),
            Default::Flag(b) => write!(f, "{b}"),
        }
    }
}

pub fn number(
    v: Option<Value>,
    key: &str,
    range: RangeInclusive<u64>,
    default: u64,
) -> Result<u64, ConfigError> {
    let range_text = || format!("must be an integer from {} to {}", range.start(), range.end());
    match v {
        None => Ok(default),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(n) if range.contains(&n) => Ok(n),
            _ => Err(err(key, format!("{}, got {n}", range_text()))),
        },
        Some(other) => Err(err(key, format!("{}, got {}", range_text(), type_name(&other)))),
    }
}

pub fn boolean(v: Option<Value>, key: &str, default: bool) -> Result<bool, ConfigError> {
    match v {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(b),
        Some(other) => Err(err(key, format!("must be true or false, got {}", type_name(&other)))),
    }
}

/// `value` as the keys of `T`: not an object, or a key `T` does not declare, is refused, named
/// under `prefix` (`""` at the top, else e.g. `"inbox."`).
pub fn object<T: for<'de> Deserialize<'de>>(value: Value, prefix: &str) -> Result<T, ConfigError> {
    let key = prefix.trim_end_matches('.');
    if !value.is_object() {
        let message = match key {
            "" => "configuration must be a JSON object".to_string(),
            _ => format!("must be an object, got {}", type_name(&value)),
        };
        return Err(err(key, message));
    }
    serde_json::from_value(value).map_err(|e| {
        let text = e.to_string();
        match text.strip_prefix("unknown field `").and_then(|rest| rest.split_once('`')) {
            Some((unknown, _)) => err(&format!("{prefix}{unknown}"), "is not a known key"),
            None => err(key, text),
        }
    })
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}
