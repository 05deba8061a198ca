"""The context's token budget (`memfilter.core.tokens`, `memfilter.core.window`), against the
libraries users run: Mastra's own TokenLimiterProcessor (@mastra/core 1.71.0, in Node:
tests/node/budget.mjs) for the estimate and the `contiguous` trim, gpt-tokenizer's o200k_base
for the exact counter; then the rules that go beyond Mastra (whole turns, the request's own
part always in, counts paid once), on random threads."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from factories import DATA

from memfilter.core.filter import decide, decode_request
from memfilter.core.tokens import ESTIMATE, O200K, _o200k, estimate
from memfilter.core.window import Budget, reasons

NODE = Path(__file__).parents[1] / "node"


def reference(**document) -> dict:
    """What tests/node/budget.mjs answers (Mastra's and gpt-tokenizer's counts and trims)."""
    done = subprocess.run(["node", "budget.mjs"], cwd=NODE, input=json.dumps(document).encode(), capture_output=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def tiktoken_o200k(tmp_path_factory, monkeypatch_module):
    """OpenAI's tiktoken with o200k_base, offline: the encoding file bpe-openai bundles, put
    in tiktoken's cache (TIKTOKEN_CACHE_DIR) where tiktoken would have downloaded it; tiktoken
    checks it against the hash it expects of o200k_base, so the file is the genuine one."""
    import gzip
    import hashlib
    from importlib.resources import files

    import tiktoken
    import tiktoken.registry

    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    _o200k()  # imports bpe_openai (and quiets its deprecated resource reads)
    cache = tmp_path_factory.mktemp("tiktoken")
    data = gzip.decompress(files("bpe_openai.data").joinpath("o200k_base.tiktoken.gz").read_bytes())
    (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(data)
    monkeypatch_module.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    tiktoken.registry.ENCODINGS.pop("o200k_base", None)
    return tiktoken.get_encoding("o200k_base")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


# ---- what the counters count --------------------------------------------------------------

PIECES = [
    "hello", "world", "Tokenization", "antidisestablishmentarianism", "a", "ab", "abc", "abcd", "12", "12,5", "3.14159", "1,000,000",
    "2026-03-01", "...", "!?", "--", "__init__", "a_b", "user@example.com", "https://example.com/a?b=c", "{\"q\": 1}", "`code`",
    "Grüße", "München", "STRAẞE", "ÄÖÜ", "café", "ÉCOLE", "naïve", "Łódź", "żółć", "český", "привет", "Καλημέρα", "東京", "日本語です",
    "カタカナ", "ひらがな", "한국어", "🙂", "👍🏽", "🇫🇷", "\u00a0", "\u3000", "\t", "\n\n", "\n  ", " ", "  ", "\ufeff", "\x1c", "\u2028",
]  # fmt: skip


def corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        out.append("".join(rng.choice(PIECES) + rng.choice(["", " ", "", ",", "\n"]) for _ in range(rng.randint(1, 14))))
    return out


def text(mid, role, words, at):
    return {"id": mid, "role": role, "createdAt": at, "content": {"format": 2, "parts": [{"type": "text", "text": words}]}}


def invocation(**inv):
    return {"type": "tool-invocation", "toolInvocation": {"toolCallId": "c1", "toolName": "lookup", **inv}}


MESSAGES = [
    {"id": "m1", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": "What's the weather in Paris tomorrow?"}]}},
    {"id": "m2", "role": "assistant", "content": {"format": 2, "parts": [{"type": "step-start"}, invocation(state="call", args={"city": "Paris"})]}},
    {"id": "m3", "role": "assistant", "content": {"format": 2, "parts": [invocation(state="partial-call", args='{"city": "Par')]}},
    {"id": "m4", "role": "assistant", "content": {"format": 2, "parts": [invocation(state="call", args={})]}},  # {} is truthy in JavaScript
    {"id": "m5", "role": "assistant", "content": {"format": 2, "parts": [invocation(state="call", args="")]}},
    {"id": "m6", "role": "assistant", "content": {"format": 2, "parts": [invocation(state="result", args={"q": 1}, result={"tempC": 18, "sky": "sunny"})]}},
    {"id": "m7", "role": "assistant", "content": {"format": 2, "parts": [invocation(state="result", args={"q": 1}, result="18 degrees")]}},
    {"id": "m8", "role": "assistant", "content": {"format": 2, "parts": [invocation(state="result", result={"data": "QUJD" * 500, "mediaType": "image/png", "n": 1})]}},
    {"id": "m9", "role": "assistant", "content": {"format": 2, "parts": [invocation(state="result", result=[{"data": "QUJD" * 80, "mimeType": "application/pdf"}])]}},
    {"id": "m10", "role": "assistant", "content": {"format": 2, "parts": [invocation(state="output-error", errorText="boom", args={"q": 1})]}},
    {"id": "m11", "role": "assistant", "content": {"format": 2, "parts": [invocation(state="approval-requested", args={"q": 1})]}},
    {"id": "m12", "role": "user", "content": {"format": 2, "parts": [{"type": "file", "mimeType": "image/jpeg", "data": "https://example.com/a.jpg"}]}},
    {"id": "m13", "role": "user", "content": {"format": 2, "parts": [{"type": "file", "mediaType": "application/pdf", "url": "data:application/pdf;base64," + "QUJD" * 300}]}},
    {"id": "m14", "role": "user", "content": {"format": 2, "parts": [{"type": "file", "mediaType": "text/plain", "url": "https://example.com/a.txt"}]}},
    {"id": "m15", "role": "assistant", "content": {"format": 2, "parts": [{"type": "reasoning", "reasoning": "think", "details": [{"type": "text", "text": "think"}]}]}},
    {"id": "m16", "role": "assistant", "content": {"format": 2, "parts": [{"type": "source", "source": {"sourceType": "url", "id": "s", "url": "https://a.b"}}]}},
    {"id": "m17", "role": "user", "content": {"format": 2, "parts": [{"type": "data-weather", "data": {"tempC": 18}}, {"type": "text", "text": "ok"}]}},
    {"id": "m18", "role": "user", "content": {"format": 2, "parts": [], "content": "from content"}},
    {"id": "m19", "role": "assistant", "content": {"format": 2, "parts": [{"type": "text", "text": "Grüße, 東京 🙂"}, invocation(state="result", result=None)]}},
    {"id": "m20", "role": "assistant", "content": {"format": 2, "parts": [invocation(state="call", toolName="", args={"nested": {"a": [1, 2.5, "x"]}})]}},
]  # fmt: skip


class TestCountsAsMastraCounts:
    def test_the_estimate_of_a_text_is_tokenx_as_mastra_bundles_it(self):
        strings = PIECES + corpus(600, seed=1)
        assert [estimate(s) for s in strings] == reference(strings=strings)["estimates"]

    def test_a_message_costs_what_mastras_count_input_message_tokens_says(self):
        ours = [ESTIMATE.message(m) for m in MESSAGES]
        assert ours == reference(messages=MESSAGES)["counts"]  # floats, equal to the last bit

    def test_the_exact_counter_encodes_as_openais_tiktoken(self, tiktoken_o200k):
        strings = PIECES + corpus(600, seed=2)
        count = _o200k()
        assert [count(s) for s in strings] == [len(tiktoken_o200k.encode_ordinary(s)) for s in strings]

    def test_the_exact_counter_counts_a_chat_as_gpt_tokenizer_encodes_it_for_gpt_4o(self):
        # Text without U+FEFF: gpt-tokenizer's JavaScript pattern reads it as whitespace, OpenAI's
        # tiktoken (above) does not, and one more token comes out.
        rng = random.Random(3)
        chats, ours = [], []
        for _ in range(40):
            system = [
                {"role": "system", "content": {"format": 2, "parts": [{"type": "text", "text": s.replace("\ufeff", "")}]}}
                for s in corpus(rng.randint(0, 2), rng.random())
            ]
            said = [s.replace("\ufeff", "") for s in corpus(rng.randint(1, 6), rng.random())]
            turns = [text(f"m{i}", ("user", "assistant")[i % 2], s, "2026-03-01T10:00:00.000Z") for i, s in enumerate(said)]
            chats.append([{"role": m["role"], "content": m["content"]["parts"][0]["text"]} for m in system + turns])
            ours.append(O200K.conversation + sum(O200K.system(m) for m in system) + sum(O200K.message(m) for m in turns))
        assert ours == reference(chats=chats)["chats"]


# ---- the window, against Mastra's contiguous trim ------------------------------------------


def thread(rng: random.Random, n: int) -> list[dict]:
    """A conversation of `n` rows, user and assistant by turns, some answers with tool calls."""
    rows = []
    for i in range(n):
        at = f"2026-03-01T10:{i // 60:02d}:{i % 60:02d}.000Z"
        words = " ".join(rng.choice(PIECES[:22]) for _ in range(rng.choice([1, 3, 8, 30, 120])))
        if i % 2 == 0:
            rows.append(text(f"u{i}", "user", words, at))
        elif rng.random() < 0.3:
            result = {"rows": [words] * rng.choice([1, 10, 60])}
            parts = [{"type": "step-start"}, invocation(state="result", args={"q": words[:20]}, result=result), {"type": "text", "text": words[:40]}]
            rows.append({"id": f"a{i}", "role": "assistant", "createdAt": at, "content": {"format": 2, "parts": parts}})
        else:
            rows.append(text(f"a{i}", "assistant", words, at))
    return rows


def request_for(rows: list[dict], system: list[str], words: str) -> tuple[dict, dict]:
    new = text("new", "user", words, "2026-03-01T11:00:00.000Z")
    messages = [{"role": "system", "content": {"format": 2, "parts": [{"type": "text", "text": s}]}} for s in system] + [new]
    return {"requestId": "q", "threadId": "t1", "resourceId": "r1", "messages": messages}, new


def ours(rows, system, words, budget, counter=ESTIMATE, history=None):
    """Our decision for a new user message on the thread, and every stored row's reason."""
    from memfilter.core.explain import Case, view_of

    body, _ = request_for(rows, system, words)
    request = decode_request(msgspec.json.encode(body), "d")
    case = Case(msgspec.Raw(b"{}"), [msgspec.Raw(msgspec.json.encode({**r, "threadId": "t1", "resourceId": "r1"})) for r in rows])
    view = view_of("t1", case)
    d = decide(request, view, 0, history if history is not None else len(rows), True, Budget(budget, counter))
    why = dict(reasons(d.fit, [r["id"] for r in rows], [])) if d.fit is not None else {}
    return d, why


def random_threads(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        rows = thread(rng, rng.randint(1, 24))
        system = corpus(rng.randint(0, 2), rng.random())
        words = " ".join(rng.choice(PIECES[:22]) for _ in range(rng.randint(1, 20)))
        whole = ESTIMATE.conversation + sum(ESTIMATE.message(r) for r in rows) + ESTIMATE.message(request_for(rows, system, words)[1])
        whole += sum(estimate("system" + s) + 3.8 for s in system)
        yield rows, system, words, max(1, int(whole * rng.choice([0.05, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0, 1.2])))


class TestTheWindowMatchesMastrasContiguousTrim:
    def test_the_rows_kept_are_mastras_but_those_before_the_first_user_row(self):
        cases = list(random_threads(150, seed=7))
        threads = [
            {"system": system, "history": rows, "input": [request_for(rows, system, words)[1]], "limit": budget} for rows, system, words, budget in cases
        ]
        answers = reference(threads=threads)["threads"]
        refused = 0
        for (rows, system, words, budget), mastra in zip(cases, answers):
            d, why = ours(rows, system, words, budget)
            if "error" in mastra:  # Mastra cannot make the request either: nothing fits
                assert d.outcome == "rejected" and d.error.type == "context-budget", (mastra, d.outcome)
                refused += 1
                continue
            ids = [m["id"] for m in map(_decoded, d.context) if m["role"] != "system"]
            turn = [mid for mid, reason in why.items() if reason == "turn"]
            assert mastra["kept"] == sorted(turn + ids, key=[r["id"] for r in rows + [{"id": "new"}]].index), budget
        assert 0 < refused < len(cases)  # both sides of the boundary were tried

    def test_the_one_difference_is_a_window_that_would_start_on_an_answer(self):
        rows = [text("u0", "user", "question " * 10, "2026-03-01T10:00:00.000Z"), text("a1", "assistant", "answer " * 10, "2026-03-01T10:00:01.000Z")]
        system, words = [], "next"
        new = request_for(rows, system, words)[1]
        budget = int(ESTIMATE.conversation + ESTIMATE.message(rows[1]) + ESTIMATE.message(new)) + 1  # room for the answer, not its question
        (mastra,) = reference(threads=[{"system": system, "history": rows, "input": [new], "limit": budget}])["threads"]
        d, why = ours(rows, system, words, budget)
        assert mastra["kept"] == ["a1", "new"]
        assert [m["id"] for m in map(_decoded, d.context)] == ["new"]
        assert why == {"u0": "budget", "a1": "turn"}


def _decoded(m):
    return m if isinstance(m, dict) else msgspec.json.decode(m)


# ---- the rules beyond Mastra, on random threads ---------------------------------------------


class TestWholeTurnsWithinTheBudget:
    @pytest.mark.parametrize("counter", [ESTIMATE, O200K], ids=["estimate", "o200k"])
    def test_every_context_fits_starts_on_a_user_row_and_holds_the_new_message(self, counter):
        for rows, system, words, budget in random_threads(200, seed=11):
            d, why = ours(rows, system, words, budget, counter)
            if d.outcome == "rejected":
                assert d.error.type == "context-budget" and f"the context budget is {budget}" in d.error.message
                continue
            context = [_decoded(m) for m in d.context]
            conversation = [m for m in context if m["role"] != "system"]
            assert d.fit.tokens <= budget
            assert conversation[0]["role"] == "user" and conversation[-1]["id"] == "new"
            assert len(context) - len(conversation) == len(system)
            total = counter.conversation + sum(counter.system(m) for m in context if m["role"] == "system") + sum(counter.message(m) for m in conversation)
            assert d.fit.tokens == pytest.approx(total)
            kept = [mid for mid, reason in why.items() if reason == "in"]
            assert kept == [r["id"] for r in rows][len(rows) - len(kept) :]  # the most recent rows, contiguous

    def test_a_row_cap_still_applies_as_mastras_last_messages_does(self):
        rows = thread(random.Random(5), 12)
        d, why = ours(rows, [], "next", 1_000_000, history=4)
        assert [r for r, reason in why.items() if reason == "rows"] == [r["id"] for r in rows[:8]]


class TestWhenNoStoredHistoryFits:
    """Not even the newest whole turn fits beside the request: the model would get the request
    alone. The filtered input says so (`historyLeftOut`); MEMFILTER_CONTEXT_NO_HISTORY=refuse
    refuses it instead, as Mastra's limiter throws."""

    ROWS = [text("u0", "user", "question " * 40, "2026-03-01T10:00:00.000Z"), text("a1", "assistant", "answer " * 40, "2026-03-01T10:00:01.000Z")]

    def budget_for(self, rows: list[dict]) -> int:
        """Room for the new message and the last row, not for its question: no whole turn fits."""
        new = request_for(rows, [], "next")[1]
        return int(ESTIMATE.conversation + ESTIMATE.message(rows[-1]) + ESTIMATE.message(new)) + 1

    def decided(self, rows, budget, no_history="send", history=None):
        body, _ = request_for(rows, [], "next")
        from memfilter.core.explain import Case, view_of

        view = view_of("t1", Case(msgspec.Raw(b"{}"), [msgspec.Raw(msgspec.json.encode({**r, "threadId": "t1", "resourceId": "r1"})) for r in rows]))
        history = len(rows) if history is None else history
        return decide(decode_request(msgspec.json.encode(body), "d"), view, 0, history, True, Budget(budget, ESTIMATE, no_history))

    def test_the_request_alone_is_sent_and_marked_left_out(self):
        d = self.decided(self.ROWS, self.budget_for(self.ROWS))
        assert d.outcome != "rejected" and [_decoded(m)["id"] for m in d.context] == ["new"] and d.fit.left_out

    def test_refuse_refuses_it_naming_the_turns_tokens_and_the_setting(self):
        d = self.decided(self.ROWS, self.budget_for(self.ROWS), "refuse")
        assert d.outcome == "rejected" and d.error.type == "context-budget"
        turn = ESTIMATE.message(self.ROWS[0]) + ESTIMATE.message(self.ROWS[1])
        assert f"not even the newest whole turn of the stored history fits: it is {turn:.1f} tokens" in d.error.message
        assert "MEMFILTER_CONTEXT_NO_HISTORY=send" in d.error.message

    @pytest.mark.parametrize(
        "rows, budget, history",
        [([], 10_000, None), (ROWS, 10_000, None), (ROWS, 0, 0)],
        ids=["no stored history", "a turn fits", "no rows asked for (MEMFILTER_HISTORY_MESSAGES=0)"],
    )
    def test_nothing_is_left_out_when_there_was_none_to_give_or_a_turn_fits(self, rows, budget, history):
        d = self.decided(rows, budget or self.budget_for(self.ROWS), "refuse", history)
        assert d.outcome != "rejected" and not d.fit.left_out

    def test_explain_shows_it(self):
        body, _ = request_for(self.ROWS, [], "next")
        case = {"request": body, "stored": [{**r, "threadId": "t1", "resourceId": "r1"} for r in self.ROWS], "contextTokens": self.budget_for(self.ROWS)}
        done = subprocess.run([sys.executable, "-m", "memfilter", "explain"], input=json.dumps(case).encode(), capture_output=True, check=True)
        assert json.loads(done.stdout)["historyLeftOut"] is True
        refused = subprocess.run(
            [sys.executable, "-m", "memfilter", "explain"], input=json.dumps({**case, "contextNoHistory": "refuse"}).encode(), capture_output=True, check=True
        )
        assert json.loads(refused.stdout)["error"]["type"] == "context-budget"


class TestCountsArePaidOnce:
    def test_a_stored_count_is_what_the_window_weighs(self):
        rows = [text("u0", "user", "q", "2026-03-01T10:00:00.000Z"), text("a1", "assistant", "a", "2026-03-01T10:00:01.000Z")]
        body, _ = request_for(rows, [], "next")
        request = decode_request(msgspec.json.encode(body), "d")
        from memfilter.core.explain import Case, view_of

        view = view_of("t1", Case(msgspec.Raw(b"{}"), [msgspec.Raw(msgspec.json.encode({**r, "threadId": "t1", "resourceId": "r1"})) for r in rows]))
        assert decide(request, view, 0, 10, True, Budget(100)).fit.start == 0
        view.counts = {"u0": 1000.0}  # as if stored: the row is not counted again
        d = decide(request, view, 0, 10, True, Budget(100))
        assert d.fit.start == 2 and d.fit.counts["u0"] == 1000.0

    def test_the_rows_to_save_carry_the_counts_the_window_made(self):
        rows = thread(random.Random(9), 6)
        d, _ = ours(rows, [], "a new question", 100_000)
        assert [r["id"] for r in d.persist] == ["new"]
        assert d.counts(ESTIMATE) == [ESTIMATE.message(d.persist[0])]


# ---- the cases, through `memfilter explain` as a user runs it --------------------------------

BUDGET_CASES = json.loads((DATA / "budget-cases.json").read_text())


@pytest.fixture(scope="module")
def explained():
    done = subprocess.run(
        [sys.executable, "-m", "memfilter", "explain"], input=json.dumps([c["case"] for c in BUDGET_CASES]).encode(), capture_output=True, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


@pytest.mark.parametrize("at", range(len(BUDGET_CASES)), ids=[c["name"] for c in BUDGET_CASES])
def test_budget_case(at, explained):
    """Each case of tests/data/budget-cases.json: the outcome, the context (system messages and
    ids), its tokens, and every stored row's tokens and why it is in or out."""
    expect, got = BUDGET_CASES[at]["expect"], explained[at]
    assert got["outcome"] == expect["outcome"]
    assert ["system" if m["role"] == "system" else m["id"] for m in got["context"]] == expect["context"]
    assert got.get("contextTokens") == expect.get("contextTokens")
    assert got.get("window") == expect.get("window")
    assert got.get("error") == expect.get("error")
