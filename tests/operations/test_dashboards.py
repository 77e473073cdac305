"""The Grafana dashboard and the Prometheus rules in deploy/ against a real scrape.

A stack of real processes (Redis, idemstore on it, a second idemstore in memory, Envoy with the
filter) gets traffic that moves the counters (a unique key, its replay, a 422, a 400, a 409, a
request without a key, then Redis stopped: degraded, 503 on a `failure_mode: closed` listener,
idemstore backend errors), then Envoy's admin `/stats/prometheus` and both idemstores' `/metrics`
are scraped. Every PromQL expression of the dashboard (panel targets and template variables) and
of the rule file is tokenized (`parse_promql`): each metric name must be in the scrape, each label
of a matcher or of a by()/without()/on() clause on that metric (or be a label Prometheus adds at
scrape time, `TARGET_LABELS`), each literal matcher value among the scraped values, and every
filter and idemstore metric must have a panel. A renamed metric or label fails here, naming the
panel or rule, instead of blanking a panel in production.

Without any Prometheus tool: the rule file's schema (groups, alert, expr, for, labels, annotations;
runbook anchors that exist) and the dashboard's (what Grafana needs to import it; no two panels
overlap). With the Debian package `prometheus` installed (promtool and the server): `promtool check
rules`, `promtool test rules` (deploy/prometheus/idempotency-rules.test.yaml), every dashboard
query through `promtool check rules` as a recording rule (PromQL syntax), and a real Prometheus
started with deploy/prometheus/prometheus.example.yml scraping the stack: every panel query returns
series, every rule evaluates, and the outage makes the guarantee-lost, unavailable and backend
alerts pending.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from support import harness as h
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.stack import plugin_config

DEPLOY = h.ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "idempotency.json"
RULES = DEPLOY / "prometheus" / "idempotency-rules.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "idempotency-rules.test.yaml"
PROMETHEUS_EXAMPLE = DEPLOY / "prometheus" / "prometheus.example.yml"

# Labels Prometheus attaches at scrape time (the job, the target, Kubernetes service discovery
# relabelled to namespace and pod): in no exposition, allowed on any metric.
TARGET_LABELS = {"job", "instance", "namespace", "pod"}
# Series Prometheus makes itself for each target (labels: target labels only).
SYNTHETIC = {"up"}
# The metric families the dashboard must show: everything the filter and idemstore export.
OWN_PREFIXES = ("idempotency_", "idemstore_")
# Grafana's built-in variables a panel query may use.
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__range_s", "__range_ms"}
SEVERITIES = {"critical", "warning", "info"}


# --------------------------------------------------------------------------------------------
# the scrape
# --------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Scrape:
    """Sample names -> label name -> the values seen, over one or more expositions."""
    labels: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    histograms: set[str] = field(default_factory=set)

    def add(self, text: str) -> None:
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                parts = line.split()
                if len(parts) >= 4 and parts[3] == "histogram":
                    self.histograms.add(parts[2])
                continue
            if not line.strip() or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            assert m, f"not a Prometheus sample line: {line!r}"
            name, labels, _ = m.groups()
            seen = self.labels.setdefault(name, {})
            for k, v in _LABEL.findall(labels or ""):
                seen.setdefault(k, set()).add(v)

    def has(self, name: str) -> bool:
        return name in self.labels or name in SYNTHETIC

    def label_names(self, name: str) -> set[str]:
        return set(self.labels.get(name, {})) | TARGET_LABELS

    def values(self, name: str, label: str) -> set[str]:
        return self.labels.get(name, {}).get(label, set())

    def family(self, name: str) -> str:
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name[: -len(suffix)] in self.histograms:
                return name[: -len(suffix)]
        return name


# --------------------------------------------------------------------------------------------
# a small PromQL tokenizer
# --------------------------------------------------------------------------------------------


class PromQLError(ValueError):
    pass


_TOKEN = re.compile(r"""
    (?P<ws>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[A-Za-z_][A-Za-z0-9_]*(?::[a-z]+)?\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}\[\]:@])
""", re.X)
_PAIRS = {"(": ")", "[": "]", "{": "}"}
AGGREGATORS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
               "quantile", "limitk", "limit_ratio"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "atan2", "offset", "inf", "nan", "start", "end"}


@dataclass
class Tok:
    kind: str
    text: str


@dataclass
class Selector:
    name: str | None
    matchers: list[tuple[str, str, str]]  # (label, op, value without quotes)
    at: int  # token index


@dataclass
class Grouping:
    kind: str
    labels: list[str]
    at: int


@dataclass
class Aggregation:
    op: str
    grouping: Grouping | None
    span: tuple[int, int]  # token indices of the argument's parentheses


@dataclass
class Query:
    selectors: list[Selector]
    aggregations: list[Aggregation]
    calls: list[tuple[str, tuple[int, int]]]
    binary_groupings: list[Grouping]
    variables: set[str]


def tokenize(expr: str) -> list[Tok]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise PromQLError(f"cannot read {expr[pos:pos + 20]!r} at offset {pos}")
        pos = m.end()
        if m.lastgroup != "ws":
            out.append(Tok(m.lastgroup, m.group()))
    return out


def _unquote(s: str) -> str:
    if s[0] == "`":
        return s[1:-1]
    return re.sub(r"\\(.)", r"\1", s[1:-1])


def parse_promql(expr: str) -> Query:
    """Metric selectors (with their matchers), aggregations (with by/without and the span of their
    argument), function calls and on/ignoring/group_* clauses of a PromQL expression (Grafana
    variables allowed). Raises PromQLError on what it cannot read or unbalanced brackets."""
    toks = tokenize(expr)
    close: dict[int, int] = {}
    stack: list[int] = []
    for i, t in enumerate(toks):
        if t.kind == "op" and t.text in _PAIRS:
            stack.append(i)
        elif t.kind == "op" and t.text in _PAIRS.values():
            if not stack or _PAIRS[toks[stack[-1]].text] != t.text:
                raise PromQLError(f"unbalanced {t.text!r}")
            close[stack.pop()] = i
    if stack:
        raise PromQLError(f"unclosed {toks[stack[-1]].text!r}")

    def text(i: int) -> str:
        return toks[i].text if i < len(toks) else ""

    def label_list(open_i: int) -> list[str]:
        labels, j = [], open_i + 1
        while j < close[open_i]:
            t = toks[j]
            if t.kind == "ident":
                labels.append(t.text)
            elif t.text != ",":
                raise PromQLError(f"unexpected {t.text!r} in a label list")
            j += 1
        return labels

    def matchers(open_i: int) -> list[tuple[str, str, str]]:
        out, j, end = [], open_i + 1, close[open_i]
        while j < end:
            if toks[j].text == ",":
                j += 1
                continue
            if j + 2 >= end or toks[j].kind != "ident" or toks[j + 1].text not in ("=", "!=", "=~", "!~") \
                    or toks[j + 2].kind != "string":
                raise PromQLError(f"not a label matcher at {' '.join(t.text for t in toks[j:j + 3])!r}")
            out.append((toks[j].text, toks[j + 1].text, _unquote(toks[j + 2].text)))
            j += 3
        return out

    selectors: list[Selector] = []
    calls: list[tuple[str, tuple[int, int]]] = []
    groupings: dict[int, Grouping] = {}
    aggregations: list[tuple[str, int, int]] = []  # (op, ident index, argument open index)
    variables = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expr))  # in strings too
    i = 0
    while i < len(toks):
        t = toks[i]
        if t.text == "[":  # a range or subquery: durations and variables only
            i = close[i] + 1
            continue
        if t.kind == "op" and t.text == "{":  # a selector without a metric name
            ms = matchers(i)
            names = [v for (k, op, v) in ms if k == "__name__" and op == "="]
            selectors.append(Selector(names[0] if names else None, [m for m in ms if m[0] != "__name__"], i))
            i = close[i] + 1
            continue
        if t.kind != "ident":
            i += 1
            continue
        low = t.text.lower()
        if low in GROUPING:
            if text(i + 1) == "(":
                groupings[i] = Grouping(low, label_list(i + 1), i)
                i = close[i + 1] + 1
            elif low in ("group_left", "group_right"):
                i += 1
            else:
                raise PromQLError(f"{t.text} without a label list")
            continue
        if low == "offset":
            i += 3 if text(i + 1) == "-" else 2
            continue
        if low in KEYWORDS:
            i += 1
            continue
        if text(i + 1) == "(":
            calls.append((t.text, (i + 1, close[i + 1])))
            if t.text in AGGREGATORS:
                aggregations.append((t.text, i, i + 1))
            i += 2
            continue
        if t.text in AGGREGATORS and text(i + 1) in ("by", "without"):
            if text(i + 2) != "(" or text(close[i + 2] + 1) != "(":
                raise PromQLError(f"{t.text} {text(i + 1)} (...) without its argument")
            open_arg = close[i + 2] + 1
            calls.append((t.text, (open_arg, close[open_arg])))
            aggregations.append((t.text, i, open_arg))
            i += 1  # the grouping is read as such next
            continue
        # A metric name.
        if text(i + 1) == "{":
            selectors.append(Selector(t.text, matchers(i + 1), i))
            i = close[i + 1] + 1
        else:
            selectors.append(Selector(t.text, [], i))
            i += 1

    aggs, claimed = [], set()
    for op, at, open_arg in aggregations:
        g = groupings.get(at + 1) if text(at + 1) in ("by", "without") else groupings.get(close[open_arg] + 1)
        if g is not None:
            if g.kind not in ("by", "without"):
                raise PromQLError(f"{op} followed by {g.kind}")
            claimed.add(g.at)
        aggs.append(Aggregation(op, g, (open_arg, close[open_arg])))
    loose = [g for at, g in groupings.items() if at not in claimed]
    stray = [g for g in loose if g.kind in ("by", "without")]
    if stray:
        raise PromQLError(f"{stray[0].kind} outside an aggregation")
    return Query(selectors, aggs, calls, loose, variables)


def check_query(expr: str, where: str, scrape: Scrape) -> tuple[list[str], set[str]]:
    """Problems of one expression against the scrape (each naming `where`), and the metric names
    it uses."""
    try:
        q = parse_promql(expr)
    except PromQLError as e:
        return [f"{where}: cannot read the PromQL ({e}): {expr}"], set()
    problems, used = [], set()
    if not q.selectors:
        problems.append(f"{where}: no metric in {expr}")
    for s in q.selectors:
        if s.name is None:
            problems.append(f"{where}: a selector without a metric name in {expr}")
            continue
        used.add(s.name)
        if not scrape.has(s.name):
            near = difflib.get_close_matches(s.name, list(scrape.labels), n=1)
            hint = f" (closest in the scrape: {near[0]})" if near else ""
            problems.append(f"{where}: metric {s.name} is not in the scrape{hint}")
            continue
        for label, op, value in s.matchers:
            if label not in scrape.label_names(s.name):
                problems.append(f"{where}: {s.name} has no label {label!r} in the scrape "
                                f"(it has {sorted(scrape.label_names(s.name) - TARGET_LABELS) or 'none'})")
            elif label not in TARGET_LABELS and "$" not in value:
                seen = scrape.values(s.name, label)
                if op == "=" and value not in seen:
                    problems.append(f"{where}: {s.name}{{{label}={value!r}}}: no such value in the scrape "
                                    f"(seen: {sorted(seen)})")
                if op == "=~" and not any(re.fullmatch(value, v) for v in seen):
                    problems.append(f"{where}: {s.name}{{{label}=~{value!r}}} matches no value in the scrape "
                                    f"(seen: {sorted(seen)})")

    def inside(span: tuple[int, int]) -> list[Selector]:
        return [s for s in q.selectors if span[0] < s.at < span[1] and s.name and scrape.has(s.name)]

    for a in q.aggregations:
        if a.grouping is None:
            continue
        for s in inside(a.span):
            for label in a.grouping.labels:
                if label not in scrape.label_names(s.name):
                    problems.append(f"{where}: {a.op} {a.grouping.kind} ({label}) over {s.name}, "
                                    f"which has no label {label!r} in the scrape")
    for name, span in q.calls:
        if name != "histogram_quantile":
            continue
        for s in inside(span):
            if not s.name.endswith("_bucket"):
                problems.append(f"{where}: histogram_quantile over {s.name}, not a _bucket series")
        for a in q.aggregations:
            if span[0] < a.span[0] < span[1]:
                g = a.grouping
                keeps_le = g is not None and ((g.kind == "by" and "le" in g.labels)
                                              or (g.kind == "without" and "le" not in g.labels))
                if not keeps_le:
                    problems.append(f"{where}: the {a.op} inside histogram_quantile drops the le label")
    every = set().union(*(scrape.label_names(s.name) for s in q.selectors if s.name and scrape.has(s.name)))
    for g in q.binary_groupings:
        for label in g.labels:
            if label not in every:
                problems.append(f"{where}: {g.kind} ({label}): no metric of the expression has that label")
    return problems, used


# --------------------------------------------------------------------------------------------
# the files
# --------------------------------------------------------------------------------------------


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def load_rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def panel_queries(dash: dict) -> list[tuple[str, str]]:
    """(where, expr) of every panel target."""
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f'panel {p["id"]} "{p["title"]}" target {t["refId"]}', t["expr"]))
    return out


_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S)


def variable_queries(dash: dict) -> list[tuple[str, str, str]]:
    """(where, selector, label) of every label_values() template variable."""
    out = []
    for v in dash["templating"]["list"]:
        if v.get("type") != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = _LABEL_VALUES.match(query)
        assert m, f"variable ${v['name']}: not a label_values(selector, label) query: {query}"
        out.append((f"variable ${v['name']}", m.group(1), m.group(2)))
    return out


def rule_queries(rules: dict) -> list[tuple[str, str]]:
    return [(f'rule {r.get("alert") or r.get("record")} (group {g["name"]})', r["expr"])
            for g in rules["groups"] for r in g["rules"]]


def all_queries() -> list[tuple[str, str]]:
    dash = load_dashboard()
    return panel_queries(dash) + [(w, sel) for w, sel, _ in variable_queries(dash)] + rule_queries(load_rules())


def substitute(expr: str, rate_interval: str) -> str:
    """A dashboard query as Grafana would send it with every variable at "All" (.*)."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*(?::[a-z]+)?\}?", ".*", expr)


def github_anchors(md: Path) -> set[str]:
    anchors = set()
    for line in md.read_text().splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return anchors


# --------------------------------------------------------------------------------------------
# the stack and its scrape
# --------------------------------------------------------------------------------------------


def fast_flush(config: dict) -> None:
    config["stats_flush_interval"] = "0.5s"  # histograms reach /stats/prometheus at each flush


@dataclass
class Scraped:
    envoy: h.Envoy
    stores: dict[str, tuple[h.Proc, int]]
    scrape: Scrape
    prometheus: "Prometheus | None"


class Prometheus:
    """A real Prometheus server (Debian's package) on loopback, with deploy/'s example config
    pointed at the test's targets, 1 s scrape and evaluation intervals."""

    def __init__(self, run_dir: Path, envoy_admin: int, store_ports: list[int]):
        cfg = yaml.safe_load(PROMETHEUS_EXAMPLE.read_text())
        cfg["global"].update({"scrape_interval": "1s", "evaluation_interval": "1s"})
        cfg["rule_files"] = [str(RULES)]
        jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
        assert set(jobs) == {"idempotency-envoy", "idemstore"}, sorted(jobs)
        jobs["idempotency-envoy"]["static_configs"] = [{"targets": [f"{h.LOOPBACK}:{envoy_admin}"]}]
        jobs["idemstore"]["static_configs"] = [{"targets": [f"{h.LOOPBACK}:{p}" for p in store_ports]}]
        sub = run_dir / "prometheus"
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / "prometheus.yml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.port = h.free_port()
        self.proc = h.start("prometheus", [shutil.which("prometheus"), f"--config.file={path}",
                                           f"--storage.tsdb.path={sub / 'data'}",
                                           f"--web.listen-address={h.LOOPBACK}:{self.port}"], run_dir)
        h.await_ready(self.proc, lambda: h.http_get_status(self.port, "/-/ready")[0] == 200, "prometheus /-/ready",
                      timeout=30)

    def api(self, path: str, **query) -> dict:
        q = f"?{urllib.parse.urlencode(query)}" if query else ""
        status, body = h.http_get_status(self.port, f"/api/v1/{path}{q}", timeout=10)
        doc = json.loads(body)
        assert status == 200 and doc["status"] == "success", (path, query, status, doc)
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def targets_up(self, n: int) -> bool:
        return len(self.query("up == 1")) >= n

    def alerts(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for a in self.api("alerts")["alerts"]:
            out.setdefault(a["labels"]["alertname"], set()).add(a["state"])
        return out


@pytest.fixture(scope="module")
def scraped(run_dir, artifacts, upstream):
    """The stack, traffic that moves every outcome, a Redis outage, and the scrape after it."""
    sub = run_dir / "dashboards"
    started: list[h.Proc] = []
    prometheus = None
    try:
        redis, rport = h.start_redis(sub)
        started.append(redis)
        store, sport = h.start_idemstore(sub, f"redis://{h.LOOPBACK}:{rport}")
        started.append(store)
        # The in-memory backend's gauges exist only there: a second idemstore, scraped too.
        memory, mport = h.start_idemstore(sub, name="idemstore-memory")
        started.append(memory)
        filters = {
            "default": [h.wasm_filter(plugin_config(lock_wait_ms=200), artifacts["wasm"])],
            "closed": [h.wasm_filter(plugin_config(failure_mode="closed"), artifacts["wasm"])],
        }
        envoy = h.await_envoy(h.spawn_envoy(sub, "envoy", filters, upstream.port, sport, config_hook=fast_flush))
        started.append(envoy.proc)
        if shutil.which("prometheus"):
            prometheus = Prometheus(sub, envoy.admin_port, [sport, mport])
            started.append(prometheus.proc)
            # Every target scraped once before the traffic, so that rates see it move.
            h.wait_for(lambda: prometheus.targets_up(3), "prometheus: 3 targets up", prometheus.proc, timeout=20)

        base = f"/orders/dash-{h.new_key('p')}"

        def post(path, body="{}", key=None, listener="default", extra=()):
            hdrs = [("content-type", "application/json"), *extra] + ([("Idempotency-Key", key)] if key else [])
            return h.request(envoy.port(listener), "POST", path, body, hdrs)

        key = h.new_key("dash")
        first = post(f"{base}/a", key=key)
        assert_executed(first, 201)
        envoy.wait_counter("stored", 1)
        assert_replay_of(post(f"{base}/a", key=key), first)
        assert_problem(post(f"{base}/a", '{"x":1}', key=key), 422)
        assert_problem(post(f"{base}/b", key="bad key"), 400)
        assert_executed(post(f"{base}/c"), 201)  # no key: passthrough
        slow = h.new_key("dash-slow")
        t, out = h.in_thread(lambda: post(f"{base}/d", key=slow, extra=[("x-test-sleep-ms", "800")]))
        h.poll_until(lambda: upstream.count(path=f"{base}/d"), 1, timeout=5)
        assert_problem(post(f"{base}/d", key=slow), 409)
        assert_executed(h.joined(t, out), 201)
        assert_executed(post(f"{base}/e", key=h.new_key("dash"), listener="closed"), 201)

        # Redis goes away: idemstore's backend is down, the filter degrades (open) or refuses (closed).
        redis.stop()
        h.wait_for(lambda: h.http_get_status(sport, "/healthz")[0] == 503, "idemstore /healthz 503", store)
        assert_executed(post(f"{base}/f", key=h.new_key("dash-down")), 201)
        assert_problem(post(f"{base}/g", key=h.new_key("dash-closed"), listener="closed"), 503)

        counters = envoy.counters()
        for name in ("guarded", "executed", "replayed", "stored", "mismatched", "rejected", "passthrough",
                     "conflicted", "degraded", "unavailable", "local_locks", "store_errors"):
            assert counters.get(name, 0) >= 1, (name, counters)

        scrape = Scrape()
        status, body = h.http_get_status(envoy.admin_port, "/stats/prometheus", timeout=5)
        assert status == 200
        scrape.add(body.decode())
        for p in (sport, mport):
            status, body = h.http_get_status(p, "/metrics", timeout=5)  # no secret needed
            assert status == 200
            scrape.add(body.decode())
        yield Scraped(envoy, {"redis": (store, sport), "memory": (memory, mport)}, scrape, prometheus)
    finally:
        for proc in reversed(started):
            proc.stop()


# --------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------


def _overlap(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def test_dashboard_is_an_importable_grafana_dashboard():
    dash = load_dashboard()
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list), ("templating", dict),
                      ("time", dict), ("tags", list), ("editable", bool)):
        assert isinstance(dash.get(key), kind), f"dashboard {key!r} must be a {kind.__name__}"
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"]), dash["uid"]
    assert dash["schemaVersion"] >= 36, "a dashboard schema of Grafana 9 or later"
    assert dash.get("id") is None, "an exported dashboard carries no database id"
    assert {"from", "to"} <= set(dash["time"])

    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert len(variables) == len(dash["templating"]["list"]), "duplicate variable names"
    ds = variables.get("datasource")
    assert ds and ds["type"] == "datasource" and ds["query"] == "prometheus", "a ${datasource} variable of Prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, v["name"]
    assert len(variable_queries(dash)) == len([v for v in variables.values() if v["type"] == "query"])

    ids, problems = set(), []
    placed = []
    in_row = False
    for p in dash["panels"]:
        where = f'panel {p.get("id")} "{p.get("title")}"'
        for key, kind in (("id", int), ("type", str), ("title", str), ("gridPos", dict)):
            if not isinstance(p.get(key), kind):
                problems.append(f"{where}: {key!r} must be a {kind.__name__}")
        if p["id"] in ids:
            problems.append(f"{where}: duplicate id")
        ids.add(p["id"])
        g = p["gridPos"]
        if not all(isinstance(g.get(k), int) for k in ("h", "w", "x", "y")):
            problems.append(f"{where}: gridPos needs integer h, w, x, y")
            continue
        if not (g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24):
            problems.append(f"{where}: gridPos {g} outside the 24-column grid")
        for other_where, other in placed:
            if _overlap(g, other):
                problems.append(f"{where} overlaps {other_where}: {g} and {other}")
        placed.append((where, g))
        if p["type"] == "row":
            in_row = True
            if p.get("collapsed") or p.get("panels"):
                problems.append(f"{where}: rows are expanded, their panels at the top level")
            continue
        if not in_row:
            problems.append(f"{where}: every panel is under a row")
        if p["type"] not in ("timeseries", "stat"):
            problems.append(f"{where}: unexpected panel type {p['type']}")
        if p.get("datasource") != {"type": "prometheus", "uid": "${datasource}"}:
            problems.append(f"{where}: datasource must be the ${{datasource}} variable")
        targets = p.get("targets")
        if not isinstance(targets, list) or not targets:
            problems.append(f"{where}: no targets")
            continue
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or not all(isinstance(r, str) and r for r in refs):
            problems.append(f"{where}: refIds must be unique strings: {refs}")
        for t in targets:
            if not isinstance(t.get("expr"), str) or not t["expr"].strip():
                problems.append(f"{where} target {t.get('refId')}: no expr")
            if t.get("datasource") != p.get("datasource"):
                problems.append(f"{where} target {t.get('refId')}: datasource differs from the panel's")
        if not isinstance(p.get("fieldConfig", {}).get("defaults"), dict):
            problems.append(f"{where}: fieldConfig.defaults missing")
    assert not problems, "\n".join(problems)

    # Every variable a query uses is defined (or a Grafana built-in), and none is unused.
    used: set[str] = set()
    for where, expr in panel_queries(dash) + [(w, s) for w, s, _ in variable_queries(dash)]:
        try:
            used |= parse_promql(expr).variables
        except PromQLError as e:
            problems.append(f"{where}: {e}")
    undefined = used - set(variables) - GRAFANA_BUILTINS
    assert not undefined, f"undefined dashboard variables: {sorted(undefined)}"
    unused = set(variables) - used - {"datasource"}
    assert not unused, f"unused dashboard variables: {sorted(unused)}"
    assert not problems, "\n".join(problems)


def test_rule_file_schema():
    doc = load_rules()
    assert isinstance(doc, dict) and set(doc) == {"groups"}, "a rule file has one key, groups"
    assert isinstance(doc["groups"], list) and doc["groups"]
    duration = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")
    names, problems = set(), []
    for g in doc["groups"]:
        assert isinstance(g, dict) and set(g) <= {"name", "interval", "limit", "rules", "query_offset"}, g
        assert isinstance(g.get("name"), str) and g["name"] not in names, g.get("name")
        names.add(g["name"])
        assert isinstance(g.get("rules"), list) and g["rules"], g["name"]
        for r in g["rules"]:
            where = f'rule {r.get("alert") or r.get("record")} (group {g["name"]})'
            extra = set(r) - {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
            if extra:
                problems.append(f"{where}: unknown keys {sorted(extra)}")
            if ("alert" in r) == ("record" in r):
                problems.append(f"{where}: exactly one of alert and record")
                continue
            if not isinstance(r.get("expr"), str) or not r["expr"].strip():
                problems.append(f"{where}: no expr")
            else:
                try:
                    parse_promql(r["expr"])
                except PromQLError as e:
                    problems.append(f"{where}: {e}")
            if "record" in r:
                continue
            if r["alert"] in names:
                problems.append(f"{where}: duplicate alert name")
            names.add(r["alert"])
            if not isinstance(r.get("for"), str) or not duration.fullmatch(r["for"]):
                problems.append(f"{where}: `for` must be a duration: {r.get('for')!r}")
            labels, ann = r.get("labels"), r.get("annotations")
            if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
                problems.append(f"{where}: labels must map to strings")
            elif labels.get("severity") not in SEVERITIES:
                problems.append(f"{where}: severity {labels.get('severity')!r} not one of {sorted(SEVERITIES)}")
            if not isinstance(ann, dict) or not all(isinstance(v, str) for v in ann.values()):
                problems.append(f"{where}: annotations must map to strings")
                continue
            for key in ("summary", "description", "runbook_url"):
                if not ann.get(key):
                    problems.append(f"{where}: no {key} annotation")
            for key, value in ann.items():
                if value.count("{{") != value.count("}}"):
                    problems.append(f"{where}: unbalanced template braces in {key}")
            link = ann.get("runbook_url", "")
            doc_path, _, anchor = link.partition("#")
            target = h.ROOT / doc_path
            if not doc_path.startswith("docs/") or not target.is_file():
                problems.append(f"{where}: runbook_url {link!r} is not a file under docs/")
            elif anchor not in github_anchors(target):
                problems.append(f"{where}: runbook_url {link!r}: no heading #{anchor} in {doc_path}")
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian package `prometheus`); the schema checks still ran")
def test_promtool_checks_rules_their_unit_tests_and_the_dashboard_queries(tmp_path):
    def promtool(*args) -> None:
        r = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, cwd=RULES.parent)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"

    promtool("check", "rules", str(RULES))
    promtool("test", "rules", str(RULE_TESTS))
    promtool("check", "config", str(PROMETHEUS_EXAMPLE))
    # The dashboard's queries as recording rules: promtool parses each (PromQL syntax).
    dash = load_dashboard()
    rules = []
    for where, expr in panel_queries(dash) + [(w, s) for w, s, _ in variable_queries(dash)]:
        rules.append({"record": "dashboard:" + re.sub(r"[^a-zA-Z0-9_]", "_", where)[:80],
                      "expr": substitute(expr, "1m")})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool("check", "rules", str(path))


def test_dashboard_and_rules_use_only_names_and_labels_of_the_scrape(scraped):
    scrape = scraped.scrape
    problems, used = [], set()
    for where, expr in all_queries():
        p, u = check_query(expr, where, scrape)
        problems += p
        used |= u
    for where, selector, label in variable_queries(load_dashboard()):
        q = parse_promql(selector)
        for s in q.selectors:
            if s.name and scrape.has(s.name) and label not in scrape.label_names(s.name):
                problems.append(f"{where}: label_values(..., {label}): {s.name} has no label {label!r}")
    assert not problems, "dashboard/rules vs the scrape of Envoy /stats/prometheus and idemstore /metrics:\n" \
        + "\n".join(problems)
    # Every metric of the filter and of idemstore is on the dashboard.
    exported = {scrape.family(n) for n in scrape.labels if n.startswith(OWN_PREFIXES)}
    shown = {scrape.family(n) for n in used}
    assert not exported - shown, f"metrics without a panel: {sorted(exported - shown)}"


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus not installed (Debian package `prometheus`)")
def test_a_real_prometheus_answers_every_panel_and_sees_the_outage(scraped):
    prom = scraped.prometheus
    assert prom is not None
    dash = load_dashboard()
    queries = [(w, substitute(e, "10s")) for w, e in panel_queries(dash)]
    queries += [(w, substitute(s, "10s")) for w, s, _ in variable_queries(dash)]
    empty: list[str] = []

    def answered() -> bool:
        empty.clear()
        empty.extend(f"{w}: {q}" for w, q in queries if not prom.query(q))
        return not empty
    try:
        h.wait_for(answered, "every dashboard query to return series", prom.proc, timeout=30, interval=0.5)
    except h.HarnessError:
        pytest.fail("dashboard queries Prometheus answers with no series:\n" + "\n".join(empty), pytrace=False)

    # Every rule evaluates without error.
    def rule_health() -> list[tuple[str, str, str]]:
        return [(r["name"], r["health"], r.get("lastError", "")) for g in prom.api("rules")["groups"]
                for r in g["rules"]]
    h.wait_for(lambda: all(health == "ok" for _, health, _ in rule_health()), "every rule evaluated ok",
               prom.proc, timeout=20)
    assert len(rule_health()) == sum(len(g["rules"]) for g in load_rules()["groups"])

    # The outage (Redis stopped after the targets were first scraped) is seen by the alerts.
    want = {"IdempotencyGuaranteeLost", "IdempotencyStoreUnavailable503", "IdemstoreBackendDown",
            "IdemstoreBackendErrors"}
    h.wait_for(lambda: want <= set(prom.alerts()), f"alerts {sorted(want)} pending", prom.proc, timeout=20)
    # A scrape that fails: up == 0.
    scraped.stores["memory"][0].stop()
    h.wait_for(lambda: "IdemstoreTargetDown" in prom.alerts(), "IdemstoreTargetDown pending", prom.proc, timeout=20)
    # The absence alerts stay quiet: the names and the job they look for are the scraped ones.
    absent = {"IdempotencyFilterMetricsAbsent", "IdemstoreMetricsAbsent", "IdemstoreNotScraped"}
    assert not absent & set(prom.alerts()), prom.alerts()
