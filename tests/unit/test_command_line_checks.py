"""What the command line refuses before it reaches any service, each in one line naming the
setting or flag and the fix; and log lines that are a normal step are not errors."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from pipeline import REPO

from memfilter.runtime.logs import Normal
from memfilter.schemas.__main__ import HERE


def memfilter(*argv: str, **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "MEMFILTER_SECRET": "s" * 32, "HOME": "/tmp"}
    return subprocess.run([sys.executable, "-m", "memfilter", *argv], capture_output=True, text=True, env={**base, **env}, cwd=REPO, timeout=60)


class TestRefusedBeforeStarting:
    def test_a_replay_range_that_ends_before_it_starts_is_refused(self):
        for start, end in (("5", "3"), ("0:9,1:9", "0:2,1:2"), ("2026-03-02T00:00:00Z", "2026-03-01T00:00:00Z")):
            result = memfilter("replay", "--from", start, "--to", end)
            assert result.returncode == 2 and "is not after --from" in result.stderr and "holds no request" in result.stderr, result.stderr

    @pytest.mark.parametrize("command", ["worker", "agent"])
    def test_a_short_secret_is_named_as_short_not_as_unset(self, command):
        result = memfilter(command, MEMFILTER_SECRET="short")
        assert result.returncode == 2 and "MEMFILTER_SECRET is 5 characters; the deployment's secret needs 16 or more" in result.stderr

    def test_an_unset_secret_is_named_as_unset(self):
        result = memfilter("worker", MEMFILTER_SECRET="")
        assert result.returncode == 2 and "MEMFILTER_SECRET is not set" in result.stderr

    @pytest.mark.parametrize("flag, value, says", [("--thread", "t\x01x", "U+0001"), ("--resource", "r" * 300, "300 characters")])
    def test_forget_refuses_a_thread_or_resource_that_is_no_id(self, flag, value, says):
        """Nothing is stored under it (the rule of every id): said at once, not after waiting for the workers."""
        result = memfilter("forget", flag, value)
        assert result.returncode == 2 and f"memfilter forget: {flag} " in result.stderr and says in result.stderr, result.stderr

    def test_an_agent_base_url_that_is_not_a_url_is_refused(self):
        result = memfilter("agent", MEMFILTER_AGENT_BASE_URL="not a url")
        assert result.returncode == 2 and "MEMFILTER_AGENT_BASE_URL='not a url' is not valid: expected an http:// or https:// URL" in result.stderr

    def test_an_agent_tools_file_that_is_not_a_list_of_tools_is_refused_naming_the_tool(self, tmp_path):
        for content, says in (
            ("[{", "cannot be read as JSON"),
            ('{"name": "f"}', "is not a JSON list of tools"),
            ('[{"name": "f", "inputSchema": 3}]', "tool 0 needs a name"),
        ):
            (tmp_path / "tools.json").write_text(content)
            result = memfilter("agent", MEMFILTER_AGENT_TOOLS=str(tmp_path / "tools.json"))
            assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr

    @pytest.mark.parametrize("command", ["worker", "agent"])
    def test_a_data_dir_whose_folder_does_not_exist_is_one_line(self, command, tmp_path):
        result = memfilter(command, MEMFILTER_DATA_DIR=str(tmp_path / "missing" / "data"))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"its folder {tmp_path / 'missing'} does not exist" in result.stderr

    def test_a_redis_cluster_whose_bus_ports_would_pass_65535_says_which_port_to_use(self, tmp_path):
        result = memfilter("stack", "up", "--redis-cluster", MEMFILTER_REDIS_PORT="57001", MEMFILTER_STACK_DIR=str(tmp_path))
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert "needs bus ports 67001-67006, past 65535: set MEMFILTER_REDIS_PORT to 55530 or lower" in result.stderr


class TestTheSchemasModule:
    def test_help_writes_nothing(self):
        before = {p: p.stat().st_mtime_ns for p in HERE.glob("*.schema.json")}
        result = subprocess.run([sys.executable, "-m", "memfilter.schemas", "--help"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.startswith("usage: python -m memfilter.schemas")
        assert {p: p.stat().st_mtime_ns for p in HERE.glob("*.schema.json")} == before

    def test_check_says_the_committed_files_are_current(self):
        result = subprocess.run([sys.executable, "-m", "memfilter.schemas", "--check"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout


class TestNormalStepsAreNotErrors:
    def test_the_coordinator_not_yet_available_on_a_first_start_is_info(self):
        record = logging.LogRecord(
            "aiokafka.consumer.group_coordinator",
            logging.ERROR,
            "",
            0,
            "Group Coordinator Request failed: %s",
            ("[Error 15] GroupCoordinatorNotAvailableError",),
            None,
        )
        Normal().filter(record)
        assert record.levelno == logging.INFO

    def test_other_errors_stay_errors(self):
        record = logging.LogRecord("aiokafka.consumer.group_coordinator", logging.ERROR, "", 0, "Heartbeat failed: %r", ("boom",), None)
        assert Normal().filter(record) and record.levelno == logging.ERROR
