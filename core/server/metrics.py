"""Prometheus metrics, in a registry of the server's own, labelled with the
model and attention backend. Engine state (running/waiting, KV usage, prefix
hits, preemptions) is read at scrape time from the engine thread's snapshot."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], labels: dict[str, str]):
        self._stats = stats
        self._labels = labels

    def collect(self):
        s = self._stats()
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        yield gauge("fw_num_requests_running", "Sequences in the running batch.", s["num_running"])
        yield gauge("fw_num_requests_waiting", "Sequences waiting for the engine.", s["num_waiting"])
        yield gauge("fw_kv_cache_usage_ratio", "Fraction of KV-cache pages in use.", s["kv_cache_usage"])
        queried = s["prefix_cache_queried_tokens"]
        yield gauge("fw_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up.",
                    s["prefix_cache_hit_tokens"] / queried if queried else 0.0)
        c = CounterMetricFamily("fw_num_preemptions", "Sequences preempted (recomputed later).", labels=names)
        c.add_metric(values, s["num_preemptions"])
        yield c
        if "spec_num_drafts" in s:  # --speculative-config (fw.speculative)
            for key, name, doc in (
                    ("spec_num_drafts", "fw_spec_decode_num_drafts", "Verify passes of a sequence's draft."),
                    ("spec_num_draft_tokens", "fw_spec_decode_num_draft_tokens", "Draft tokens proposed."),
                    ("spec_num_accepted_tokens", "fw_spec_decode_num_accepted_tokens", "Draft tokens accepted.")):
                c = CounterMetricFamily(name, doc, labels=names)
                c.add_metric(values, s[key])
                yield c
            c = CounterMetricFamily("fw_spec_decode_num_accepted_tokens_per_pos",
                                    "Drafts whose token at a position was accepted.", labels=[*names, "position"])
            for position, count in enumerate(s["spec_accepted_per_position"]):
                c.add_metric([*values, str(position)], count)
            yield c
            yield gauge("fw_spec_decode_mean_acceptance_length", "Tokens emitted per verify pass (1 + accepted "
                        "/ drafts).", s["spec_mean_acceptance_length"])
        if "data_parallel" in s:  # --data-parallel-size (fw.distributed.data_parallel): one sample per replica
            up = GaugeMetricFamily("fw_replica_up", "1 while a data-parallel replica serves, 0 once it is lost.",
                                   labels=[*names, "replica"])
            served = CounterMetricFamily("fw_replica_requests", "Requests routed to a data-parallel replica.",
                                         labels=[*names, "replica"])
            for replica in s["data_parallel"]:
                up.add_metric([*values, str(replica["replica"])], float(replica["alive"]))
                served.add_metric([*values, str(replica["replica"])], replica["requests_served"])
            yield up
            yield served
        if "num_compilations" in s:  # --enable-torch-compile (fw.compile): unchanged after warm-up
            c = CounterMetricFamily("fw_compilations", "Graphs torch.compile built or loaded for the model step.",
                                    labels=names)
            c.add_metric(values, s["num_compilations"])
            yield c


class _StartupCollector:
    """The engine's startup report (fw.warm.startup), read at scrape time so phases recorded after the
    server was built show up too: fw_startup_phase_seconds{phase="load weights"} per phase, and
    fw_startup_ready_seconds, process start to accepting requests."""

    def __init__(self, report, labels: dict[str, str]):
        self._report = report
        self._labels = labels

    def collect(self):
        names, values = list(self._labels), list(self._labels.values())
        g = GaugeMetricFamily("fw_startup_phase_seconds", "Seconds each start-up phase took (resolve, load "
                              "weights, allocate KV cache, compile/capture, ...).", labels=[*names, "phase"])
        for phase, seconds in self._report.as_dict().items():
            g.add_metric([*values, phase], seconds)
        yield g
        if self._report.ready_seconds is not None:
            ready = GaugeMetricFamily("fw_startup_ready_seconds", "Seconds from process start to serving.",
                                      labels=names)
            ready.add_metric(values, self._report.ready_seconds)
            yield ready


class ServerMetrics:
    def __init__(self, model: str, attention_backend: str, engine_stats: Callable[[], dict],
                 startup=None):
        self.registry = CollectorRegistry()
        labels = {"model_name": model, "attention_backend": attention_backend}
        self.labels = labels
        names = list(labels)
        r = self.registry
        self.requests = Counter("fw_request_success", "Finished requests by finish reason.",
                                [*names, "finished_reason"], registry=r)
        self.errors = Counter("fw_request_errors", "Requests answered with an error, by HTTP status.",
                              [*names, "status"], registry=r)
        self.prompt_tokens = Counter("fw_prompt_tokens", "Prompt tokens of finished requests.", names, registry=r)
        self.generation_tokens = Counter("fw_generation_tokens", "Generated tokens.", names, registry=r)
        self.ttft = Histogram("fw_time_to_first_token_seconds", "Time to first token.", names,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fw_inter_token_latency_seconds", "Time between output tokens.", names,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("fw_e2e_request_latency_seconds", "Request latency, arrival to last token.", names,
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(engine_stats, labels))
        if startup is not None:  # a fw.warm.startup.StartupReport
            r.register(_StartupCollector(startup, labels))

    def request_finished(self, finish_reasons: list[str | None], prompt_tokens: int, generated: int,
                         e2e: float) -> None:
        for reason in finish_reasons:
            self.requests.labels(**self.labels, finished_reason=reason or "abort").inc()
        self.prompt_tokens.labels(**self.labels).inc(prompt_tokens)
        self.generation_tokens.labels(**self.labels).inc(generated)
        self.e2e.labels(**self.labels).observe(e2e)

    def error(self, status: int) -> None:
        self.errors.labels(**self.labels, status=str(status)).inc()
