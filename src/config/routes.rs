//! `routes`: a policy per Envoy route, by the route's name. Envoy 1.40 has no per-route
//! configuration for Wasm filters (no `WasmPerRoute`: each Wasm configuration is a VM of its
//! own), so the policies are a section of the plugin configuration, chosen on each request by
//! the `xds.route_name` attribute.
//!
//! A policy sets per-request keys only; every key it leaves out is inherited from the top level
//! *as written* (an inherited key the route's mode does not use is left out), and the result is
//! checked as a whole configuration, so every rule of a configuration holds for each route. The
//! keys that shape a worker (its store, its breaker, its local records) stay filter-wide: one
//! worker serves every route.

use std::collections::BTreeMap;
use std::rc::Rc;

use serde_json::{Map, Value};

use crate::config::keys::{err, object, type_name, ConfigError};
use crate::config::{Config, RawConfig};

/// Keys a policy may not set: they shape the worker every route shares, or (`pause_on_headers`)
/// must match the filter's Envoy configuration.
pub const FILTER_WIDE: &[&str] = &[
    "store_cluster",
    "store",
    "store_timeout_ms",
    "store_transport",
    "store_streams",
    "store_secret",
    "store_secret_env",
    "breaker_failures",
    "breaker_open_ms",
    "local_fallback",
    "local_record_entries",
    "local_record_bytes",
    "record_cache_entries",
    "record_cache_bytes",
    "pause_on_headers",
    "failure_mode",
    "routes",
];

/// Keys inbox mode refuses: a route that turns inbox mode on does not inherit them.
const NOT_IN_INBOX: &[&str] = &[
    "fingerprint_headers",
    "fingerprint_json",
    "store_statuses",
    "record_too_large",
    "require_key",
    "subject",
];

pub const MAX_ROUTES: usize = 256;
pub const MAX_ROUTE_NAME: usize = 255;

/// Each route's configuration, whole (its policy over the top level).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routes(BTreeMap<String, Rc<Config>>);

impl Routes {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The configuration of the route named `name`, if it has a policy.
    pub fn get(&self, name: &[u8]) -> Option<&Rc<Config>> {
        self.0.get(std::str::from_utf8(name).ok()?)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Config)> {
        self.0.iter().map(|(name, cfg)| (name.as_str(), cfg.as_ref()))
    }

    /// `routes` as written: `top` is the rest of the configuration as written.
    pub fn parse(
        value: Value,
        top: &RawConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Routes, ConfigError> {
        let Value::Object(policies) = value else {
            return Err(err(
                "routes",
                format!("must be an object of policies by Envoy route name, got {}", type_name(&value)),
            ));
        };
        if policies.len() > MAX_ROUTES {
            return Err(err("routes", format!("may name at most {MAX_ROUTES} routes")));
        }
        let inherited = written(top);
        let mut routes = BTreeMap::new();
        for (name, policy) in policies {
            if name.is_empty() || name.len() > MAX_ROUTE_NAME || name.chars().any(char::is_control) {
                return Err(err(
                    "routes",
                    format!(
                        "route names must be 1 to {MAX_ROUTE_NAME} characters without control characters"
                    ),
                ));
            }
            let cfg = route(&name, policy, &inherited, env)?;
            routes.insert(name, Rc::new(cfg));
        }
        Ok(Routes(routes))
    }

    /// The policies as an operator would write them: each route's per-request keys, explicit.
    pub fn to_raw(&self) -> Value {
        let policies: Map<String, Value> = self
            .0
            .iter()
            .map(|(name, cfg)| {
                let mut policy = written(&cfg.to_raw());
                policy.retain(|key, _| !FILTER_WIDE.contains(&key.as_str()));
                (name.clone(), Value::Object(policy))
            })
            .collect();
        Value::Object(policies)
    }
}

/// The keys of `raw` that are set.
fn written(raw: &RawConfig) -> Map<String, Value> {
    match serde_json::to_value(raw) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    }
}

/// One route's configuration: its `policy` over the `inherited` keys, checked as a whole.
fn route(
    name: &str,
    policy: Value,
    inherited: &Map<String, Value>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigError> {
    let prefix = format!("routes.{name}.");
    let named =
        |e: ConfigError| ConfigError { key: format!("{prefix}{}", e.key).trim_end_matches('.').into(), ..e };
    // Parsed for its keys alone (unknown ones are refused by name); the values are checked below.
    let set = written(&object::<RawConfig>(policy, &prefix)?);
    if let Some(key) = set.keys().find(|k| FILTER_WIDE.contains(&k.as_str())) {
        return Err(err(&format!("{prefix}{key}"), "is filter-wide: set it at the top level"));
    }
    let mut merged = inherited.clone();
    match set.get("mode") {
        None => {}
        Some(Value::String(m)) if m == "inbox" => merged.retain(|k, _| !NOT_IN_INBOX.contains(&k.as_str())),
        Some(Value::String(m)) if m == "idempotency_key" => {
            merged.remove("inbox");
        }
        Some(_) => {
            return Err(err(
                &format!("{prefix}mode"),
                "must be \"idempotency_key\" or \"inbox\" in a route's policy (mint and grpc_replay \
                 are a listener's role: set them at the top level)",
            ))
        }
    }
    merged.extend(set);
    let raw: RawConfig = object(Value::Object(merged), "").map_err(named)?;
    Config::validate(raw, env).map_err(named)
}
