//! A fake host for the unit tests: it records every call ([`HostCall`]) and every log line, answers
//! ids and tokens from a counter, and fails the calls it is told to ([`Fake::fail`]).

use std::cell::{Cell, RefCell};
use std::fmt;
use std::time::Duration;

use super::calls::{GrpcStream, HostCalls, HttpCall, LocalReply, Map, MetricKind, Status};
use crate::sim::worker::tally::SimEnv;
use crate::worker::env::Env;

/// One host call, with its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostCall {
    SetEffectiveContext(u32),
    SendLocalResponse {
        status: u32,
        headers: Vec<(String, String)>,
        body: Option<Vec<u8>>,
        trailers: Option<Vec<(String, String)>>,
    },
    ResumeRequest,
    SetHeader {
        map: Map,
        name: String,
        value: Option<String>,
    },
    AddHeader {
        map: Map,
        name: String,
        value: String,
    },
    SetRequestBody {
        start: usize,
        size: usize,
        value: Vec<u8>,
    },
    CallForeignFunction(String),
    SetProperty {
        path: Vec<String>,
        value: Vec<u8>,
    },
    DispatchHttpCall {
        cluster: String,
        headers: Vec<(String, String)>,
        body: Option<Vec<u8>>,
        timeout: Duration,
    },
    OpenGrpcStream {
        service: String,
        grpc_service: String,
        method: String,
        metadata: Vec<(String, Vec<u8>)>,
    },
    GrpcSend {
        token: u32,
        message: Vec<u8>,
    },
    GrpcCancel(u32),
    RegisterSharedQueue(String),
    EnqueueSharedQueue {
        queue: u32,
        value: Vec<u8>,
    },
    DefineMetric {
        kind: MetricKind,
        name: String,
    },
    IncrementMetric {
        id: u32,
        offset: i64,
    },
    RecordMetric {
        id: u32,
        value: u64,
    },
    SetTickPeriod(Duration),
}

type Rule = (Box<dyn Fn(&HostCall) -> bool>, Status);

pub struct Fake {
    calls: RefCell<Vec<HostCall>>,
    logs: RefCell<Vec<(log::Level, String)>>,
    failing: RefCell<Vec<Rule>>,
    next_id: Cell<u32>,
    env: SimEnv,
}

impl Default for Fake {
    fn default() -> Fake {
        Fake {
            calls: RefCell::default(),
            logs: RefCell::default(),
            failing: RefCell::default(),
            next_id: Cell::new(100),
            env: SimEnv::at(1_700_000_000_000_000),
        }
    }
}

impl Fake {
    /// From now on every call `which` matches fails with `status` (it is still recorded).
    pub fn fail(&self, which: impl Fn(&HostCall) -> bool + 'static, status: Status) {
        self.failing.borrow_mut().push((Box::new(which), status));
    }

    /// The calls so far, forgotten.
    pub fn take_calls(&self) -> Vec<HostCall> {
        std::mem::take(&mut self.calls.borrow_mut())
    }

    /// The log lines so far, forgotten.
    pub fn take_logs(&self) -> Vec<(log::Level, String)> {
        std::mem::take(&mut self.logs.borrow_mut())
    }

    /// The id or token the next successful call that returns one gets.
    pub fn next_id(&self) -> u32 {
        self.next_id.get()
    }

    fn call(&self, call: HostCall) -> Result<(), Status> {
        let failed = self.failing.borrow().iter().find(|(which, _)| which(&call)).map(|(_, s)| *s);
        self.calls.borrow_mut().push(call);
        failed.map_or(Ok(()), Err)
    }

    fn call_for_id(&self, call: HostCall) -> Result<u32, Status> {
        self.call(call)?;
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        Ok(id)
    }
}

impl HostCalls for Fake {
    fn set_effective_context(&self, context: u32) -> Result<(), Status> {
        self.call(HostCall::SetEffectiveContext(context))
    }

    fn send_local_response(&self, r: LocalReply<'_>) -> Result<(), Status> {
        let (status, headers, body) = (r.status, r.headers.to_vec(), r.body.map(<[u8]>::to_vec));
        let trailers = r.trailers.map(<[_]>::to_vec);
        self.call(HostCall::SendLocalResponse { status, headers, body, trailers })
    }

    fn resume_request(&self) -> Result<(), Status> {
        self.call(HostCall::ResumeRequest)
    }

    fn set_header(&self, map: Map, name: &str, value: Option<&str>) -> Result<(), Status> {
        self.call(HostCall::SetHeader { map, name: name.into(), value: value.map(String::from) })
    }

    fn add_header(&self, map: Map, name: &str, value: &str) -> Result<(), Status> {
        self.call(HostCall::AddHeader { map, name: name.into(), value: value.into() })
    }

    fn set_request_body(&self, start: usize, size: usize, value: &[u8]) -> Result<(), Status> {
        self.call(HostCall::SetRequestBody { start, size, value: value.to_vec() })
    }

    fn call_foreign_function(&self, name: &str) -> Result<(), Status> {
        self.call(HostCall::CallForeignFunction(name.into()))
    }

    fn set_property(&self, path: &[&str], value: &[u8]) -> Result<(), Status> {
        self.call(HostCall::SetProperty {
            path: path.iter().map(|p| p.to_string()).collect(),
            value: value.to_vec(),
        })
    }

    fn dispatch_http_call(&self, c: HttpCall<'_>) -> Result<u32, Status> {
        self.call_for_id(HostCall::DispatchHttpCall {
            cluster: c.cluster.into(),
            headers: c.headers.into_iter().map(|(n, v)| (n.into(), v.into())).collect(),
            body: c.body.map(<[u8]>::to_vec),
            timeout: c.timeout,
        })
    }

    fn open_grpc_stream(&self, s: GrpcStream<'_>) -> Result<u32, Status> {
        self.call_for_id(HostCall::OpenGrpcStream {
            service: s.service.into(),
            grpc_service: s.grpc_service.into(),
            method: s.method.into(),
            metadata: s.metadata.into_iter().map(|(n, v)| (n.into(), v.to_vec())).collect(),
        })
    }

    fn grpc_send(&self, token: u32, message: &[u8]) -> Result<(), Status> {
        self.call(HostCall::GrpcSend { token, message: message.to_vec() })
    }

    fn grpc_cancel(&self, token: u32) -> Result<(), Status> {
        self.call(HostCall::GrpcCancel(token))
    }

    fn register_shared_queue(&self, name: &str) -> Result<u32, Status> {
        self.call_for_id(HostCall::RegisterSharedQueue(name.into()))
    }

    fn enqueue_shared_queue(&self, queue: u32, value: &[u8]) -> Result<(), Status> {
        self.call(HostCall::EnqueueSharedQueue { queue, value: value.to_vec() })
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, Status> {
        self.call_for_id(HostCall::DefineMetric { kind, name: name.into() })
    }

    fn increment_metric(&self, id: u32, offset: i64) -> Result<(), Status> {
        self.call(HostCall::IncrementMetric { id, offset })
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status> {
        self.call(HostCall::RecordMetric { id, value })
    }

    fn set_tick_period(&self, period: Duration) -> Result<(), Status> {
        self.call(HostCall::SetTickPeriod(period))
    }

    fn log(&self, level: log::Level, message: fmt::Arguments<'_>) {
        self.logs.borrow_mut().push((level, message.to_string()));
    }

    fn env(&self) -> &dyn Env {
        &self.env
    }
}
