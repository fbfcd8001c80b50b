"""``examples/grafana/``: every metric the dashboard queries is served by a live agent's ``GET /metrics``.

The metric names are read out of each PromQL expression of the dashboard (panels, annotations, the node variable)
by a small extractor (:func:`metric_names`); a simulated agent runs on loopback (FairBatching, so the prefill
admission budget is served too) and its ``/metrics`` is fetched over HTTP after some requests finished. The
exposition is read with ``prometheus_client``'s parser where it is installed (vLLM brings it), and with a minimal
one as well, which must agree. With ``promtool`` (Prometheus) on the PATH, the expressions and the scrape config
are also checked by Prometheus's own parser.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_harness import make_hub, make_server, run, wait_for

ROOT = Path(__file__).resolve().parents[3]
GRAFANA = ROOT / "examples" / "grafana"
DASHBOARD = GRAFANA / "trackside.json"

# -- reading the dashboard ------------------------------------------------------------------------------------
PROMQL_KEYWORDS = frozenset({
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
    "inf", "nan", "atan2",
})
"""Words of PromQL that are not metric names (functions and aggregations are told apart by their ``(``)."""
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` (PromQL, possibly with Grafana variables) selects: every identifier left once
    strings, label matchers, ranges and grouping label lists are taken out, but function and aggregation names
    (followed by ``(``), keywords and numbers (``1m``, ``0.99``, ``1e3``)."""
    text = _STRING.sub('""', _GRAFANA_VARIABLE.sub("", expr))
    text = _LABEL_LIST.sub(" ", _RANGE.sub(" ", _MATCHERS.sub(" ", text)))
    return {m.group(1) for m in _IDENTIFIER.finditer(text)
            if m.group(2) is None and m.group(1).lower() not in PROMQL_KEYWORDS}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """Every PromQL expression of ``dashboard`` with where it is: panel targets, annotations, query variables
    (``label_values(SELECTOR, label)``: the selector)."""
    found = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in _panels(dashboard["panels"])
             for t in p.get("targets", [])]
    found += [(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", query.strip())
            assert m, f"variable {var['name']}: {query}"
            found.append((f"variable {var['name']!r}", m.group(1)))
    return found


def unserved(dashboard: dict[str, Any], served: set[str]) -> list[str]:
    """``where: name`` for each metric the dashboard queries that is not in ``served``."""
    return [f"{where}: {name}" for where, expr in dashboard_queries(dashboard) for name in sorted(metric_names(expr))
            if name not in served]


def load_dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


# -- reading the exposition -----------------------------------------------------------------------------------
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\d+)?$")


def sample_names_minimal(text: str) -> set[str]:
    """The names of the samples of a text exposition (format 0.0.4), comments skipped."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, f"unparseable sample line {line!r}"
            names.add(m.group(1))
    return names


def sample_names(text: str) -> set[str]:
    """The names of the samples of ``text``: by ``prometheus_client``'s parser where it is installed (checked
    against the minimal one), else by the minimal one."""
    minimal = sample_names_minimal(text)
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return minimal
    parsed = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert parsed == minimal
    return parsed


@pytest.fixture(scope="module")
def served() -> set[str]:
    """The sample names of a live simulated agent's ``GET /metrics`` once more than 20 requests finished."""

    async def go() -> tuple[str, str]:
        hub = make_hub(units=2, batch_policy="fairbatching", workload="poisson:n=400,rate=40")
        async with make_server(hub) as server:
            await wait_for(lambda: hub.node.num_finished > 20, what="finished requests")
            url = f"http://127.0.0.1:{server.port}/metrics"

            def get() -> tuple[str, str]:
                with urllib.request.urlopen(url, timeout=10) as response:
                    return response.headers["Content-Type"], response.read().decode()

            return await asyncio.to_thread(get)

    content_type, text = run(go)
    assert content_type.startswith("text/plain; version=0.0.4")
    return sample_names(text)


# -- the extractor --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("expr", "names"), [
    ('histogram_quantile(0.99, sum by (le, instance) (rate(vllm:time_to_first_token_seconds_bucket'
     '{instance=~"$instance"}[$__rate_interval])))', {"vllm:time_to_first_token_seconds_bucket"}),
    ('sum(rate(a_total{x="b c", y!~"sum(d)"}[5m])) by (engine) / ignoring(by) sum(b_count offset 1m)',
     {"a_total", "b_count"}),
    ("max by (instance) (x + y and on (instance, engine) z{mode='active'}) - min without(le) (w)",
     {"x", "y", "z", "w"}),
    ("changes(c_total[${__range}]) > bool 0 or vector(1e3) unless Inf * NaN", {"c_total"}),
    ("max_over_time(rate(d[1m])[5m:30s]) @ start()", {"d"}),
    ("topk(3, e) or count_values(\"v\", f)", {"e", "f"}),
])
def test_the_extractor_finds_metric_names_and_nothing_else(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_the_minimal_parser_reads_samples_not_comments() -> None:
    text = '# HELP a_total x\n# TYPE a_total counter\na_total{x="1 2"} 3\nvllm:h_bucket{le="+Inf"} 1 1700000000\n'
    assert sample_names_minimal(text) == {"a_total", "vllm:h_bucket"}


# -- the dashboard against a live agent -----------------------------------------------------------------------
def test_every_metric_the_dashboard_queries_is_served(served: set[str]) -> None:
    dashboard = load_dashboard()
    queried = {name for _, expr in dashboard_queries(dashboard) for name in metric_names(expr)}
    # What the issue asks for is there (an extractor that found nothing would pass the check below).
    assert queried >= {
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "trackside_requests_finished_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
        "trackside_slo_attained_total", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
        "vllm:num_requests_waiting", "trackside_batch_policy_info", "trackside_control_changes_total",
    }
    assert unserved(dashboard, served) == []


def test_a_panel_on_a_metric_the_agent_does_not_serve_is_caught(served: set[str]) -> None:
    dashboard = load_dashboard()
    panel = next(p for p in dashboard["panels"] if p["type"] == "timeseries")
    panel["targets"].append({"refId": "Z", "expr": 'sum(vllm:num_requests_swapped{instance=~"$instance"})'})
    dashboard["annotations"]["list"].append({"name": "typo", "expr": "changes(trackside_batch_policy_inf[1m]) > 0"})
    assert unserved(dashboard, served) == [
        f"panel {panel['title']!r} Z: vllm:num_requests_swapped", "annotation 'typo': trackside_batch_policy_inf",
    ]


def test_every_query_follows_the_variables() -> None:
    """Each panel reads the data source variable, and each metric selector filters on the node variable."""
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["multi"] and variables["instance"]["includeAll"]
    for panel in _panels(dashboard["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]
    for where, expr in dashboard_queries(dashboard):
        if where.startswith("variable"):
            continue
        for name in metric_names(expr):
            for m in re.finditer(rf"(?<![\w:]){re.escape(name)}(?![\w:])(\{{[^}}]*\}})?", expr):
                assert 'instance=~"$instance"' in (m.group(1) or ""), (where, name)


# -- Prometheus's own parser, where it is installed -----------------------------------------------------------
def grafana_free(expr: str) -> str:
    """``expr`` with Grafana's variables as Prometheus would receive them."""
    for var, value in (("$__rate_interval", "1m"), ("$__range", "1h"), ("$__interval", "1m"), ("$instance", ".*")):
        expr = expr.replace(var, value)
    return expr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Prometheus)")
def test_promtool_parses_every_expression_and_the_scrape_config(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": grafana_free(expr)}
        for i, (_, expr) in enumerate(dashboard_queries(load_dashboard()))]}]}
    (tmp_path / "rules.yml").write_text(json.dumps(rules))  # YAML is a superset of JSON
    for argv in (["check", "rules", str(tmp_path / "rules.yml")], ["check", "config", str(GRAFANA / "prometheus.yml")]):
        done = subprocess.run(["promtool", *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
