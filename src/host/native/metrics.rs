//! The filter's metrics as the module's: defined when the configuration is made (Envoy refuses
//! definitions after), updated from any thread through the configuration (Envoy's stats are
//! thread-safe). Names drop the wasm filter's `idempotency.` prefix: Envoy puts the module's
//! `metrics_namespace` there (`idempotency` in the shipped configurations, so `/stats` reads as
//! for the wasm filter).

use super::abi::{self, MetricsResult, ModuleBuffer};
use super::module::ConfigEnvoy;
use crate::host::calls::{MetricKind, Status};
use crate::request::metrics::{Metric, LOCAL_RECORDS, STORE_LATENCY, STREAM_CALLS};

const PREFIX: &str = "idempotency.";

/// Each metric: its name as the core defines it, its kind, Envoy's id.
pub struct Metrics(Vec<(&'static str, MetricKind, usize)>);

fn failed(result: MetricsResult) -> Result<(), Status> {
    if result == MetricsResult::SUCCESS {
        Ok(())
    } else {
        Err(Status(100 + result.0))
    }
}

impl Metrics {
    /// On the main thread, in `config_new`.
    pub fn define(envoy: abi::HttpFilterConfigEnvoyPtr) -> Result<Metrics, String> {
        let counters = Metric::ALL.iter().map(|m| (m.name(), MetricKind::Counter));
        let histograms = STORE_LATENCY.iter().map(|(_, name)| (*name, MetricKind::Histogram));
        let gauges = [LOCAL_RECORDS, STREAM_CALLS].into_iter().map(|name| (name, MetricKind::Gauge));
        let mut defined = Vec::new();
        for (name, kind) in counters.chain(histograms).chain(gauges) {
            let short = name.strip_prefix(PREFIX).unwrap_or(name);
            let mut id = 0usize;
            let buffer = ModuleBuffer::from_str(short);
            // SAFETY: the configuration Envoy is making; the name outlives the call.
            let result = unsafe {
                match kind {
                    MetricKind::Counter => {
                        abi::envoy_dynamic_module_callback_http_filter_config_define_counter(
                            envoy,
                            buffer,
                            std::ptr::null(),
                            0,
                            &mut id,
                        )
                    }
                    MetricKind::Gauge => abi::envoy_dynamic_module_callback_http_filter_config_define_gauge(
                        envoy,
                        buffer,
                        std::ptr::null(),
                        0,
                        &mut id,
                    ),
                    MetricKind::Histogram => {
                        abi::envoy_dynamic_module_callback_http_filter_config_define_histogram(
                            envoy,
                            buffer,
                            std::ptr::null(),
                            0,
                            &mut id,
                        )
                    }
                }
            };
            failed(result).map_err(|s| format!("cannot define metric {short}: {s:?}"))?;
            defined.push((name, kind, id));
        }
        Ok(Metrics(defined))
    }

    /// The core's id for `name`: its place in the table.
    pub fn find(&self, kind: MetricKind, name: &str) -> Option<u32> {
        let at = self.0.iter().position(|(n, k, _)| *n == name && *k == kind)?;
        u32::try_from(at).ok()
    }

    /// Whether `id` is a histogram: Envoy records those in its worker threads' caches only.
    pub fn is_histogram(&self, id: u32) -> bool {
        self.0.get(id as usize).is_some_and(|(_, kind, _)| *kind == MetricKind::Histogram)
    }

    pub fn increment(&self, envoy: &ConfigEnvoy, id: u32, offset: i64) -> Result<(), Status> {
        let &(_, kind, envoy_id) = self.0.get(id as usize).ok_or(Status(1))?;
        let (envoy, by) = (envoy.0, offset.unsigned_abs());
        // SAFETY: a live configuration (it outlives every worker's use) and an id it defined.
        failed(unsafe {
            match kind {
                MetricKind::Counter if offset >= 0 => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_counter(
                        envoy,
                        envoy_id,
                        std::ptr::null(),
                        0,
                        by,
                    )
                }
                MetricKind::Gauge if offset >= 0 => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_gauge(
                        envoy,
                        envoy_id,
                        std::ptr::null(),
                        0,
                        by,
                    )
                }
                MetricKind::Gauge => abi::envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
                    envoy,
                    envoy_id,
                    std::ptr::null(),
                    0,
                    by,
                ),
                _ => return Err(Status(2)),
            }
        })
    }

    pub fn record(&self, envoy: &ConfigEnvoy, id: u32, value: u64) -> Result<(), Status> {
        let &(_, kind, envoy_id) = self.0.get(id as usize).ok_or(Status(1))?;
        let envoy = envoy.0;
        // SAFETY: as `increment`.
        failed(unsafe {
            match kind {
                MetricKind::Gauge => abi::envoy_dynamic_module_callback_http_filter_config_set_gauge(
                    envoy,
                    envoy_id,
                    std::ptr::null(),
                    0,
                    value,
                ),
                MetricKind::Histogram => {
                    abi::envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
                        envoy,
                        envoy_id,
                        std::ptr::null(),
                        0,
                        value,
                    )
                }
                MetricKind::Counter => return Err(Status(2)),
            }
        })
    }
}
