//! Random event sequences through the shared driver ([`crate::sim::request`]).

use super::*;

/// Random event sequences through the shared driver ([`crate::sim::request`]), which checks after every
/// event that the machine never answers twice, never resumes after answering, and that every lock
/// it is handed ends in exactly one commit or release. `fuzz/` runs the same driver for longer.
#[test]
fn random_event_sequences_keep_the_invariants() {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut seen = Tally::default();
    for _ in 0..12_000 {
        let mut v = MockView::post(if next(5) == 0 { None } else { Some("k") });
        v.prop("xds.cluster_name", "app");
        v.request_body = vec![b'x'; 120];
        if next(4) == 0 {
            // A gRPC call: one message of 7 bytes, then what looks like a second one.
            v.req("content-type", "application/grpc");
            v.request_body[..5].copy_from_slice(&[0, 0, 0, 0, 7]);
            let status = ["0", "5", "x"][next(3) as usize];
            v.response_trailers = vec![("grpc-status".into(), status.as_bytes().to_vec())];
        }
        let configs = [
            r#""#,
            r#","failure_mode":"closed""#,
            DETACHED,
            r#","fingerprint_json":{"ignore":["/a"]},"store_statuses":["2xx","404"],"fingerprint_headers":["x-t"]"#,
            r#","record_too_large":"release","store_content_types":["application/json"]"#,
            r#","unknown_outcome":"run_again""#,
            r#","store_key_header":"x-k","outcome_lookup":{"path":"/by-key/{key}"}"#,
        ];
        let mut d = Driver::new(cfg(configs[next(7) as usize]), v);
        for _ in 0..12 {
            let event = match next(10) {
                0 => Event::RequestHeaders { end_of_stream: next(2) == 0 },
                1 => Event::RequestBody { buffered: next(121) as usize, end_of_stream: next(2) == 0 },
                2 => Event::RequestTrailers,
                3 => Event::BeginAnswer(match next(10) {
                    8 | 9 => Ok(BeginAnswer::InDoubt {
                        token: "t0".into(),
                        started_ms: 1,
                        running_ms: [0, 0, 2_000][next(3) as usize],
                    }),
                    0 => Ok(BeginAnswer::Busy { lock_ms: [None, Some(1), Some(90_000)][next(3) as usize] }),
                    1 => Ok(BeginAnswer::Mismatch),
                    2 => Ok(BeginAnswer::Replay(Record::status_only(200))),
                    3 => Err(CalloutFault::Reset),
                    4 => Ok(BeginAnswer::Replay(Record {
                        status: 404,
                        headers: vec![("content-encoding".into(), "gzip".into())],
                        body: b"x".to_vec(),
                        body_omitted: false,
                        print: Some(crate::store::record::RequestPrint {
                            target: [next(2) as u8; 32],
                            headers: vec![],
                        }),
                        trailers: None,
                        expires_ms: None,
                    })),
                    _ => Ok(BeginAnswer::Locked { token: "".into() }),
                }),
                4 | 5 => {
                    let mut headers = vec![(
                        ":status".to_string(),
                        ["200", "201", "204", "500", "302", "404"][next(6) as usize].as_bytes().to_vec(),
                    )];
                    if let Some(ct) = [
                        Some("application/json"),
                        Some("text/plain"),
                        Some("text/event-stream"),
                        Some("application/grpc"),
                        None,
                    ][next(5) as usize]
                    {
                        headers.push(("content-type".into(), ct.as_bytes().to_vec()));
                    }
                    if next(4) == 0 {
                        headers.push(("content-length".into(), next(80).to_string().into_bytes()));
                    }
                    let details = [
                        None,
                        Some("via_upstream"),
                        Some("via_upstream"),
                        Some("response_timeout"),
                        Some("upstream_reset_before_response_started{remote_reset}"),
                        Some("upstream_reset_before_response_started{remote_connection_failure}"),
                        Some("no_healthy_upstream"),
                    ][next(7) as usize];
                    Event::ResponseHeaders {
                        headers,
                        details: details.map(String::from),
                        end_of_stream: next(3) == 0,
                    }
                }
                6 | 7 => {
                    Event::ResponseBody { chunk: vec![b'y'; next(41) as usize], end_of_stream: next(3) == 0 }
                }
                8 => Event::ResponseTrailers,
                9 if next(2) == 0 => Event::UpstreamAnswer(match next(6) {
                    0 => Err(CalloutFault::Timeout),
                    1 => Err(CalloutFault::Reset),
                    n => Ok(answer(["201", "500", "404", "200"][(n - 2) as usize], None, b"")),
                }),
                _ => Event::StreamEnd,
            };
            if let Err(e) = d.step(event) {
                panic!("{e}");
            }
        }
        if let Err(e) = d.finish() {
            panic!("{e}");
        }
        let t = d.tally;
        for (sum, n) in [
            (&mut seen.responds, t.responds),
            (&mut seen.resumes, t.resumes),
            (&mut seen.upstreams, t.upstreams),
            (&mut seen.begins, t.begins),
            (&mut seen.commits, t.commits),
            (&mut seen.releases, t.releases),
            (&mut seen.in_doubt, t.in_doubt),
            (&mut seen.lookups, t.lookups),
        ] {
            *sum += n;
        }
    }
    // The sample reaches every path, so the invariants above were checked on each.
    assert!(
        [
            seen.responds,
            seen.resumes,
            seen.upstreams,
            seen.begins,
            seen.commits,
            seen.releases,
            seen.in_doubt,
            seen.lookups
        ]
        .iter()
        .all(|&n| n >= 20),
        "{seen:?}"
    );
}
