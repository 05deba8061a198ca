"""The worker's Prometheus metrics, served on its web server at `/metrics`.

One registry per worker (so tests can run several in one process). What an operator watches:

| metric | type | what |
|---|---|---|
| `memfilter_requests_total{outcome}` | counter | requests handled, by the filter's outcome; `rejected` for dead letters, `duplicate` for a retry of a request in its thread's retry window (a dead letter too), `redelivered` for a request re-delivered before its outputs were committed (its recorded events sent again) |
| `memfilter_dead_letters_total{error_type}` | counter | records sent to the dead-letter topic, by `error.type` (persister rejections included) |
| `memfilter_persisted_total` | counter | `persist-messages` events of other services applied to Redis |
| `memfilter_decision_seconds` | histogram | the filter's decision for one request (pure CPU) |
| `memfilter_end_to_end_seconds` | histogram | record timestamp to its outputs committed (the batch's transaction) |
| `memfilter_batch_size` | histogram | records per batch |
| `memfilter_batch_phase_seconds{phase}` | histogram | where a batch's time goes, one observation per batch and phase, in order: `waiting` (the age of its oldest record of the first input topic, `chat-requests`, when fetched: the time in Kafka), `previous-commit` (waiting for the batch before's transactions), `catch-up` (for `persist-messages` records committed before its requests), `handling` (deciding and Redis), `committing` (its transactions; a batch with nothing to send leaves its offsets to a later one, or commits them alone after a second) |
| `memfilter_redis_round_trips_total` | counter | pipelined Redis round trips |
| `memfilter_cold_loads_total` | counter | threads loaded back into Redis from PostgreSQL (docs/postgres.md) |
| `memfilter_context_history_left_out_total` | counter | filtered inputs whose context holds no stored history because not even its newest whole turn fit the token budget (`historyLeftOut`; MEMFILTER_CONTEXT_NO_HISTORY=send) |
| `memfilter_consumer_lag{topic,partition}` | gauge | offsets not yet consumed, per assigned partition (0 when idle: transaction markers count as consumed) |
| `memfilter_assigned_partitions` | gauge | partitions this worker holds |
| `memfilter_turns_total{how}` | counter | requests that came while their thread's reply was being made (MEMFILTER_CONCURRENT_TURNS, docs/delivery.md): `waited` (began waiting for their turn), `interrupted` (began waiting, and stopped that reply), `lapsed` (decided without the reply they waited for: not saved within MEMFILTER_TURN_WAIT_S), `rejected` (`busy-thread`) |
| `memfilter_turns_waiting` | gauge | threads of this worker's partitions with requests waiting for their turn (as of its last sweep, every second) |
| `memfilter_turn_waited_seconds` | histogram | a request's wait for its turn, record time to decision (`waited.ms` of its filtered input) |

The agent runner's (`memfilter agent`, `AgentMetrics`):

| metric | type | what |
|---|---|---|
| `memfilter_agent_inputs_total{result}` | counter | filtered inputs handled: `answered`, `no-reply` (the context asks for none), `dead-letter` |
| `memfilter_agent_outputs_total{kind}` | counter | records committed: `reply` (persist-messages events), `dead-letter` |
| `memfilter_agent_model_seconds` | histogram | one model call, retries included |
| `memfilter_batch_phase_seconds{phase}` | histogram | as the worker's (`waiting` of `filtered-inputs`; `handling` holds the model calls) |
| `memfilter_consumer_lag{topic,partition}` | gauge | as the worker's, for `filtered-inputs` |
| `memfilter_assigned_partitions` | gauge | partitions of `filtered-inputs` this runner holds |

The gateway's (`memfilter gateway`, `GatewayMetrics`):

| metric | type | what |
|---|---|---|
| `memfilter_gateway_requests_total{outcome}` | counter | `POST /api/chat` answered: `answered` (a reply streamed), `no-reply` (the request asks for none), a rejection's reason code (`ownership`, `duplicate`, ...), `unauthenticated`, `busy`, `rate-limited`, `timeout`; a stream cut: `stalled` (its client stopped reading), `stopping` (the gateway stopped); resumes: `resumed`, and those cut |
| `memfilter_gateway_wait_seconds{for}` | histogram | publish to the worker's decision (`decision`), and to the agent's saved reply (`reply`) |
| `memfilter_gateway_in_flight` | gauge | requests waiting now |
| `memfilter_gateway_jwks_fetches_total` | counter | fetches of the identity provider's keys (MEMFILTER_GATEWAY_JWKS_URL): on a schedule, and on a token of an unknown key id at most every 5 s |

The sink's (`memfilter sink`, `SinkMetrics`):

| metric | type | what |
|---|---|---|
| `memfilter_sink_threads_written_total` | counter | thread writes to PostgreSQL |
| `memfilter_sink_threads_evicted_total` | counter | idle threads taken out of Redis |
| `memfilter_sink_retries_total` | counter | batches written again, or evictions paused, because PostgreSQL or Redis did not answer |
| `memfilter_sink_refused_total` | counter | thread writes PostgreSQL refused for their data (a row it cannot hold): the thread stays in Redis, logged with the reason |

All add the Prometheus client's standard collectors: `process_*` (CPU, resident memory,
open files), `python_info` and `python_gc_*`.
"""

from __future__ import annotations

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)
_BATCH_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2000)


class _Registry:
    """A registry of one's own (so tests can run several in one process), with the standard collectors."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(standard)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 when never set), e.g. `value("memfilter_requests_total", outcome="new")`."""
        return self.registry.get_sample_value(name, labels) or 0.0


class LoopMetrics(_Registry):
    """What every transactional task loop reports (`memfilter.runtime.loop`)."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.lag = Gauge("memfilter_consumer_lag", "Records not yet consumed", ["topic", "partition"], registry=r)
        self.assigned = Gauge("memfilter_assigned_partitions", "Partitions this process holds", registry=r)
        self.batch_phase = Histogram("memfilter_batch_phase_seconds", "Where a batch's time goes, by phase", ["phase"], buckets=_LATENCY_BUCKETS, registry=r)


class Metrics(LoopMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.requests = Counter("memfilter_requests", "Requests handled, by outcome", ["outcome"], registry=r)
        self.dead_letters = Counter("memfilter_dead_letters", "Records sent to the dead-letter topic", ["error_type"], registry=r)
        self.persisted = Counter("memfilter_persisted", "persist-messages events of other services applied", registry=r)
        self.decision = Histogram("memfilter_decision_seconds", "One request's filter decision", buckets=_DECISION_BUCKETS, registry=r)
        self.end_to_end = Histogram("memfilter_end_to_end_seconds", "Record timestamp to outputs committed", buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("memfilter_batch_size", "Records per batch", buckets=_BATCH_BUCKETS, registry=r)
        self.round_trips = Counter("memfilter_redis_round_trips", "Pipelined Redis round trips", registry=r)
        self.cold_loads = Counter("memfilter_cold_loads", "Threads loaded back into Redis from PostgreSQL", registry=r)
        self.history_left_out = Counter("memfilter_context_history_left_out", "Contexts without stored history: not one turn fit the budget", registry=r)
        self.turns = Counter("memfilter_turns", "Requests that came while a reply was being made, by what they did", ["how"], registry=r)
        self.turns_waiting = Gauge("memfilter_turns_waiting", "Threads with requests waiting for their turn, of this worker's partitions", registry=r)
        self.turn_waited = Histogram("memfilter_turn_waited_seconds", "A request's wait for its turn", buckets=_LATENCY_BUCKETS + (60, 120, 300), registry=r)


class AgentMetrics(LoopMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.inputs = Counter("memfilter_agent_inputs", "Filtered inputs handled, by result", ["result"], registry=r)
        self.outputs = Counter("memfilter_agent_outputs", "Records committed, by kind", ["kind"], registry=r)
        self.model_seconds = Histogram("memfilter_agent_model_seconds", "One model call", buckets=_LATENCY_BUCKETS, registry=r)
        self.finishes = Counter("memfilter_agent_replies", "Replies saved, by finish reason", ["finish"], registry=r)
        self.tokens = Counter("memfilter_agent_tokens", "Tokens the model reported, input and output", ["kind"], registry=r)


class GatewayMetrics(_Registry):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.requests = Counter("memfilter_gateway_requests", "Chat requests answered, by outcome", ["outcome"], registry=r)
        self.wait = Histogram("memfilter_gateway_wait_seconds", "Publish to decision, and to saved reply", ["for"], buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("memfilter_gateway_in_flight", "Chat requests waiting now", registry=r)
        self.jwks_fetches = Counter("memfilter_gateway_jwks_fetches", "Fetches of the identity provider's keys", registry=r)
        self.partitions = Gauge(
            "memfilter_gateway_partitions", "Partitions of the outcome topics read now: the gateway's share, and those it holds requests on", registry=r
        )
        self.forwarded = Counter("memfilter_gateway_forwarded", "Requests and resumes forwarded to the gateway whose share their thread is in", registry=r)


class SinkMetrics(_Registry):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.written = Counter("memfilter_sink_threads_written", "Thread writes to PostgreSQL", registry=r)
        self.evicted = Counter("memfilter_sink_threads_evicted", "Idle threads taken out of Redis", registry=r)
        self.retries = Counter("memfilter_sink_retries", "Writes tried again, or evictions paused, for an outage", registry=r)
        self.refused = Counter("memfilter_sink_refused", "Thread writes PostgreSQL refused for their data", registry=r)


class EmbedderMetrics(_Registry):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.embedded = Counter("memfilter_embedder_messages_embedded", "Saved messages embedded and kept for recall", registry=r)
        self.retries = Counter("memfilter_embedder_retries", "Batches tried again for an outage (Kafka, PostgreSQL, the embeddings endpoint)", registry=r)
        self.refused = Counter("memfilter_embedder_refused", "Messages the embeddings endpoint refused for their text: not recalled", registry=r)
