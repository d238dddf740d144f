"""Prometheus metrics of one worker: vLLM's names where vLLM has the metric, `lorafleet:` beyond.

Gauges of engine state are refreshed from an `EngineSnapshot` taken on the engine thread when
`/metrics` is scraped; engine totals (cache hits, evictions, deferrals) are mirrored into counters
by their increase since the last scrape. Latency histograms are observed on the engine thread as
tokens come out (`StepObserver`). One `CollectorRegistry` per app: no module-level state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.lora.fetch import FetchStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
# Running requests and tokens per engine step (powers of two and the usual batch limits).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 60, 64, 96, 128, 192, 256, 384, 512)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
LOAD_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FETCH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(slots=True)
class EngineSnapshot:
    """Engine state for gauges and the inventory, taken on the engine thread."""

    running: int
    waiting: int
    waiting_by_reason: dict[str, int]
    running_adapters: list[str]
    waiting_adapters: list[str]
    kv_cache_usage: float
    adapter_tiers: dict[str, str]
    adapter_in_flight: dict[str, int]
    totals: dict[str, int]  # monotonically growing engine counters
    new_load_seconds: dict[str, list[float]] = field(default_factory=dict)  # tier -> since last snapshot
    adapter_meta: dict[str, tuple[bool, int]] = field(default_factory=dict)  # name -> (pinned, rank)


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """Call on the engine thread."""
    sched, registry = engine.scheduler, engine.registry
    reasons = {"capacity": 0, "deferred": 0, "loading": 0}
    for seq in sched.waiting:
        if not all(registry.on_cpu(n) for n in seq.adapter_names):
            reasons["loading"] += 1  # adapter on its way from disk into the CPU cache
        elif seq.deferred_steps > 0:
            reasons["deferred"] += 1  # held back by the max_loras limit
        else:
            reasons["capacity"] += 1  # token budget, max_num_seqs or KV blocks
    stats = registry.stats
    new_loads: dict[str, list[float]] = {}
    for tier, seconds in stats.load_seconds.items():
        # Drain: the registry keeps only what no scrape has taken yet (bounded there too).
        new_loads[tier] = list(seconds)
        seconds.clear()
    return EngineSnapshot(
        running=len(sched.running),
        waiting=len(sched.waiting),
        waiting_by_reason=reasons,
        running_adapters=sorted(sched.running_adapters()),
        waiting_adapters=sorted(sched.waiting_adapters()),
        kv_cache_usage=engine.blocks.usage(),
        adapter_tiers={name: registry.tier(name) for name in registry.names()},
        adapter_in_flight={name: e.in_flight for name, e in registry.entries.items() if not e.removed},
        totals={
            "deferred": sched.deferred_total,
            "preemptions": sched.preempted_total,
            "cpu_hits": stats.cpu_hits,
            "cpu_misses": stats.cpu_misses,
            "gpu_hits": stats.gpu_hits,
            "gpu_misses": stats.gpu_misses,
            "cpu_evictions": stats.cpu_evictions,
            "gpu_evictions": stats.gpu_evictions,
            "prefix_hit_tokens": engine.blocks.prefix_hits,
            "prefix_query_tokens": engine.blocks.prefix_queries,
        },
        new_load_seconds=new_loads,
        adapter_meta={name: (e.pinned, e.rank) for name, e in registry.entries.items() if not e.removed},
    )


class WorkerMetrics:
    """All of a worker's metrics in their own registry; also the engine's `StepObserver`."""

    def __init__(self, model_name: str, max_loras: int) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.max_loras = max_loras
        m = ("model_name",)
        # -- vLLM-compatible -----------------------------------------------------------------------
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", m, registry=r)
        self.waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason: deferred (no adapter slot under max_loras), loading (adapter "
            "on its way from disk), capacity (token budget, max_num_seqs or KV blocks).",
            (*m, "reason"), registry=r,
        )
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", m, registry=r)
        self.lora_info = Gauge(
            "vllm:lora_requests_info", "Running and waiting adapters (comma-separated names); value: unix time.",
            ("running_lora_adapters", "waiting_lora_adapters", "max_lora"), registry=r,
        )
        # vLLM's residency metrics (vLLM PR #54830, read by llm-d's lora-load-state scorer): one
        # series per adapter in a GPU slot or the CPU cache (not on disk), and the GPU slot count.
        self.adapter_loaded = Gauge(
            "vllm:lora_adapter_loaded", "1 for each adapter loaded, by level (gpu, cpu).",
            ("adapter_name", "level", "pinned", "rank"), registry=r,
        )
        self.max_gpu_adapters = Gauge(
            "vllm:max_gpu_lora_adapters", "Adapters the GPU slots hold at once (max_loras).", registry=r
        )
        self.max_gpu_adapters.set(max_loras)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted (recomputed later).", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", (*m, "finished_reason"), registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", m, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request.", m,
            buckets=ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.", m,
            buckets=E2E_BUCKETS, registry=r,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Tokens computed per engine step.", m, buckets=TOKEN_BUCKETS, registry=r
        )
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up.", m, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from cache.", m, registry=r)
        # -- beyond vLLM -----------------------------------------------------------------------------
        self.resident = Gauge(
            "lorafleet:lora_adapter_resident", "1 for each adapter at its current tier (gpu, cpu, disk).",
            ("adapter", "tier"), registry=r,
        )
        self.in_flight = Gauge(
            "lorafleet:lora_adapter_requests_in_flight", "Requests in flight per adapter.", ("adapter",), registry=r
        )
        self.adapters_by_tier = Gauge(
            "lorafleet:lora_adapters", "Registered adapters per tier.", ("tier",), registry=r
        )
        self.load_seconds = Histogram(
            "lorafleet:lora_load_seconds", "Adapter load latency into a tier: cpu (disk -> CPU cache), "
            "gpu (CPU cache -> GPU slot).", ("tier",), buckets=LOAD_BUCKETS, registry=r,
        )
        self.cache_hits = Counter("lorafleet:lora_cache_hits", "Adapter lookups found in a tier.", ("tier",), registry=r)
        self.cache_misses = Counter(
            "lorafleet:lora_cache_misses", "Adapter lookups that had to load into a tier.", ("tier",), registry=r
        )
        self.cache_evictions = Counter(
            "lorafleet:lora_cache_evictions", "Adapters evicted from a tier.", ("tier",), registry=r
        )
        self.deferred = Counter(
            "lorafleet:requests_deferred", "Scheduling passes that deferred a request for lack of an adapter slot.",
            registry=r,
        )
        # Whether the batch is kept full under load (issue 55): running requests at each step, and
        # each step's wall time by path (a prompt joining decodes outside the graphs runs eagerly).
        self.step_running = Histogram(
            "lorafleet:step_running_requests", "Requests in the running batch at each engine step.", m,
            buckets=BATCH_BUCKETS, registry=r,
        )
        self.step_waiting = Histogram(
            "lorafleet:step_waiting_requests", "Requests waiting at each engine step.", m, buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "lorafleet:step_duration_seconds", "Wall time of each engine step, by path: graph (replayed from "
            "the decode graphs' buffers) or eager (op by op).", (*m, "path"), buckets=STEP_BUCKETS, registry=r,
        )
        self.admin_loads = Counter(
            "lorafleet:lora_admin_loads", "Admin load calls by result.", ("result",), registry=r
        )
        # Remote adapter sources (s3://, hf://; worker/lora/fetch.py), mirrored from `FetchStats`.
        s = ("scheme",)
        self.fetch_counters = {
            "bytes": Counter("lorafleet:adapter_fetch_bytes", "Bytes of adapter files downloaded.", s, registry=r),
            "hits": Counter("lorafleet:adapter_fetch_cache_hits", "Remote adapter fetches answered from the "
                            "worker's adapter cache.", s, registry=r),
            "misses": Counter("lorafleet:adapter_fetch_cache_misses", "Remote adapter fetches that downloaded.", s,
                              registry=r),
            "retries": Counter("lorafleet:adapter_fetch_retries", "Remote calls retried after a transient error "
                               "(5xx, 429, connection reset, timeout).", s, registry=r),
            "errors": Counter("lorafleet:adapter_fetch_errors", "Remote adapter fetches refused, by reason.",
                              (*s, "reason"), registry=r),
        }
        self.fetch_seconds = Histogram(
            "lorafleet:adapter_fetch_seconds", "Time to download a remote adapter's files (cache misses).", s,
            buckets=FETCH_BUCKETS, registry=r,
        )
        self._last_totals: dict[str, int] = {}
        self._last_fetch: dict[tuple[str, str, str], int] = {}

    # -- StepObserver (engine thread) ------------------------------------------------------------
    def on_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)
        self.generation_tokens.labels(self.model_name).inc()

    def on_token_gap(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)
        self.generation_tokens.labels(self.model_name).inc()

    def on_finished(self, reason: str, prompt_tokens: int, generated: int, seconds: float) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        if reason != "abort":
            self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
            self.e2e.labels(self.model_name).observe(seconds)

    def on_step(self, running: int, waiting: int, tokens: int, seconds: float, path: str) -> None:
        name = self.model_name
        self.step_running.labels(name).observe(running)
        self.step_waiting.labels(name).observe(waiting)
        self.iteration_tokens.labels(name).observe(tokens)
        self.step_seconds.labels(name, path).observe(seconds)

    # -- scrape ------------------------------------------------------------------------------------
    def update(self, snap: EngineSnapshot) -> None:
        name = self.model_name
        self.running.labels(name).set(snap.running)
        self.waiting.labels(name).set(snap.waiting)
        for reason, count in snap.waiting_by_reason.items():
            self.waiting_by_reason.labels(name, reason).set(count)
        self.kv_usage.labels(name).set(snap.kv_cache_usage)
        self.lora_info.clear()
        self.lora_info.labels(
            ",".join(snap.running_adapters), ",".join(snap.waiting_adapters), str(self.max_loras)
        ).set(time.time())
        self.resident.clear()
        self.adapter_loaded.clear()
        tiers = {"gpu": 0, "cpu": 0, "disk": 0}
        for adapter, tier in snap.adapter_tiers.items():
            self.resident.labels(adapter, tier).set(1)
            if tier in ("gpu", "cpu"):
                pinned, rank = snap.adapter_meta.get(adapter, (False, 0))
                self.adapter_loaded.labels(adapter, tier, str(pinned).lower(), str(rank)).set(1)
            tiers[tier] = tiers.get(tier, 0) + 1
        for tier, count in tiers.items():
            self.adapters_by_tier.labels(tier).set(count)
        self.in_flight.clear()
        for adapter, count in snap.adapter_in_flight.items():
            self.in_flight.labels(adapter).set(count)
        # Engine tier names: "disk" loads land in the CPU cache, "cpu" loads land in a GPU slot.
        for engine_tier, seconds in snap.new_load_seconds.items():
            target = {"disk": "cpu", "cpu": "gpu"}.get(engine_tier, engine_tier)
            for s in seconds:
                self.load_seconds.labels(target).observe(s)
        for key, counter in (
            ("deferred", self.deferred),
            ("preemptions", self.preemptions.labels(name)),
            ("cpu_hits", self.cache_hits.labels("cpu")),
            ("cpu_misses", self.cache_misses.labels("cpu")),
            ("gpu_hits", self.cache_hits.labels("gpu")),
            ("gpu_misses", self.cache_misses.labels("gpu")),
            ("cpu_evictions", self.cache_evictions.labels("cpu")),
            ("gpu_evictions", self.cache_evictions.labels("gpu")),
            ("prefix_hit_tokens", self.prefix_hits.labels(name)),
            ("prefix_query_tokens", self.prefix_queries.labels(name)),
        ):
            value = snap.totals.get(key, 0)
            increase = value - self._last_totals.get(key, 0)
            if increase > 0:
                counter.inc(increase)
            self._last_totals[key] = max(value, self._last_totals.get(key, 0))

    def update_fetch(self, stats: FetchStats) -> None:
        """Mirror the fetcher's totals by their increase since the last scrape; take its new durations."""
        totals, seconds = dict(stats.totals), stats.take_seconds()
        for key, value in totals.items():
            counter, scheme, reason = key
            increase = value - self._last_fetch.get(key, 0)
            if increase > 0:
                metric = self.fetch_counters[counter]
                (metric.labels(scheme, reason) if counter == "errors" else metric.labels(scheme)).inc(increase)
            self._last_fetch[key] = max(value, self._last_fetch.get(key, 0))
        for scheme, s in seconds:
            self.fetch_seconds.labels(scheme).observe(s)
