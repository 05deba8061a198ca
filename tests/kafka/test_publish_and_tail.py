"""`memfilter publish` and `memfilter tail` as a user runs them, against a worker."""

from __future__ import annotations

import asyncio
import json

from pipeline import REPO, read

from memfilter.core.filtered import whole

SAMPLE = REPO / "deploy" / "samples" / "conversation.jsonl"


def test_a_bad_line_is_named_with_its_reason_and_nothing_is_sent(pipeline, tmp_path):
    lines = SAMPLE.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["messages"][0]["role"] = "tool"
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join([lines[0], json.dumps(bad), *lines[2:]]) + "\n")
    result = pipeline.memfilter("publish", str(requests))
    assert result.returncode == 1
    err = result.stderr.strip().splitlines()
    assert err[0].startswith("memfilter publish: line 2: schema:")
    assert err[1:] == ["memfilter publish: 1 invalid request; nothing published (--skip-invalid sends the valid ones)"]
    sent = asyncio.run(read(pipeline.bootstrap, [pipeline.topics.requests], until=lambda r: False, timeout=3))
    assert sent == []

    skipped = pipeline.memfilter("publish", "--skip-invalid", str(requests))
    assert skipped.returncode == 0 and "published 5 requests" in skipped.stdout and "skipped line 2" in skipped.stderr


def test_publish_worker_tail_shows_the_filtered_inputs_of_the_sample_session(pipeline):
    pipeline.start_worker()
    published = pipeline.memfilter("publish", str(SAMPLE))
    assert published.returncode == 0 and published.stdout.strip() == "published 6 requests to " + pipeline.topics.requests

    as_json = pipeline.memfilter("tail", "--json", "--thread", "demo-thread", "--from-beginning", "--max", "6", "--idle-ms", "60000")
    events = [whole(json.loads(line)) for line in as_json.stdout.splitlines()]  # the records as they are: format 2
    assert [e["requestId"] for e in events] == [f"demo-{k}" for k in range(6)]
    assert [e["outcome"] for e in events] == ["unchanged"] + ["user-tail"] * 5
    for sent, event in zip(SAMPLE.read_text().splitlines(), events):
        messages = json.loads(sent)["messages"]
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        assert [m["id"] for m in event["messages"]] == [m["id"] for m in messages[last_assistant + 1 :]]

    readable = pipeline.memfilter("tail", "--thread", "demo-thread", "--from-beginning", "--max", "6", "--idle-ms", "30000")
    lines = readable.stdout.splitlines()
    assert len(lines) == 6 and all(line.startswith("demo-thread  demo-") for line in lines)
    assert "user-tail" in lines[1] and "dropped 2" in lines[1]
