"""The house rules the package keeps: one installed name's parts depend one way, every package it
imports is one it declares, settings come in typed parts, the Lua scripts and the code that
calls them agree on names, and the one module that reads redis-py's internals refuses a
redis-py it was not written for."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import aiokafka
import pytest
import redis

import memfilter
from memfilter.runtime import kafka_driver
from memfilter.settings import SettingError, Settings, Topics
from memfilter.store import redis_driver, scripts

PACKAGE = Path(memfilter.__file__).parent


def imports_of(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / (module.replace(".", "/") + ".py")).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def modules() -> dict[str, Path]:
    """The installed package's modules, by name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "node_modules" in path.parts:
            continue
        parts = ["memfilter", *path.relative_to(PACKAGE).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth of its code, `TYPE_CHECKING` too)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memfilter"):
                targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in known)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(sorted([v, *group]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


class TestOneWayDependencies:
    def test_no_two_modules_import_each_other_through_any_path(self):
        assert cycles(import_graph()) == []

    def test_the_cycle_check_finds_a_cycle(self):
        assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

    def test_the_worker_and_the_agent_runner_share_the_task_loop_and_neither_imports_the_other(self):
        worker, agent = imports_of("runtime.worker"), imports_of("runtime.agent")
        assert "memfilter.runtime.loop" in worker and "memfilter.runtime.loop" in agent
        assert not any(name.startswith("memfilter.runtime.agent") for name in worker)
        assert not any(name.startswith("memfilter.runtime.worker") for name in agent)

    @pytest.mark.parametrize("module", ["core.filter", "core.thread", "core.ui", "core.replies", "core.explain", "core.origin", "store.layout"])
    def test_the_pure_core_and_the_layout_import_no_io(self, module):
        io = ("aiokafka", "redis", "faust", "mode", "openai", "asyncio", "memfilter.runtime", "memfilter.store.history", "memfilter.store.redis_driver")
        assert not [name for name in imports_of(module) if name.startswith(io)]

    def test_nothing_but_the_redis_driver_reads_redis_py_internals(self):
        readers = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if "redis._" in p.read_text() or "._parser" in p.read_text()]
        assert readers == [Path("store/redis_driver.py")]

    def test_nothing_but_the_kafka_driver_touches_aiokafka_internals(self):
        touches = ("from aiokafka.consumer", "from aiokafka.protocol", "._coordinator", "._send_req")
        readers = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if any(t in p.read_text() for t in touches)]
        assert readers == [Path("runtime/kafka_driver.py")]

    def test_every_consumer_of_a_group_is_made_by_the_kafka_driver(self):
        makers = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if re.search(r"AIOKafkaConsumer\([^)]*group_id=(?!None)", p.read_text())]
        assert makers == [Path("runtime/kafka_driver.py")]


def normal(distribution: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


class TestEveryImportIsDeclared:
    @staticmethod
    def declared() -> set[str]:
        """The distributions pyproject.toml declares for the product: its dependencies and its
        extras' (not the tests' and the developers' extras)."""
        project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
        extras = [reqs for extra, reqs in project["optional-dependencies"].items() if extra not in ("test", "dev")]
        return {normal(re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0]) for r in [*project["dependencies"], *(r for reqs in extras for r in reqs)]}

    def test_every_package_the_code_imports_is_a_dependency_pyproject_declares(self):
        """An import of a package that arrives only as another's dependency would break the
        install the day that package drops it; one missing from the extras breaks the wheel
        (`tests/system/test_installed.py` runs every command from it)."""
        declared = self.declared()
        distributions = importlib.metadata.packages_distributions()
        imported = set()
        import memfilter.schemas

        for path in [*PACKAGE.rglob("*.py"), *Path(memfilter.schemas.__file__).parent.rglob("*.py")]:
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.level == 0
                    else []
                )
                imported.update(n.partition(".")[0] for n in names if n)
        third_party = {m for m in imported - set(sys.stdlib_module_names) if m != "memfilter"}
        undeclared = {m: distributions.get(m) for m in third_party if not {normal(d) for d in distributions.get(m, [])} & declared}
        assert undeclared == {}, f"imported but not declared in pyproject.toml (module: its distributions): {undeclared}"


class TestSettingsComeInParts:
    def test_topic_names_are_read_once_and_every_part_takes_them_from_there(self):
        s = Settings.from_env({"MEMFILTER_TOPIC_REQUESTS": "in", "MEMFILTER_TOPIC_DLQ": "dead", "MEMFILTER_TOPIC_STOPS": "stops"})
        assert s.topics == Topics(requests="in", filtered="filtered-inputs", persist="persist-messages", dlq="dead", stops="stops")
        assert s.topics.all() == ("in", "filtered-inputs", "persist-messages", "dead", "reply-streams", "stops")
        assert s.topics.relays() == ("reply-streams", "stops")

    def test_the_decision_policy_is_one_object_made_from_its_settings(self):
        policy = Settings.from_env({"MEMFILTER_HISTORY_MESSAGES": "3", "MEMFILTER_EDITS": "off", "MEMFILTER_MAX_MESSAGES": "7"}).policy
        assert (policy.history, policy.edits, policy.limits.max_messages) == (3, False, 7)

    def test_a_bad_value_names_its_variable_and_what_it_takes(self):
        with pytest.raises(SettingError, match=r"^MEMFILTER_AGENT_WEB_PORT='0' is not valid: expected `int` >= 1"):
            Settings.from_env({"MEMFILTER_AGENT_WEB_PORT": "0"})


class TestScriptsTakeNamedArguments:
    @pytest.mark.parametrize("script", scripts.ALL, ids=lambda s: s.name)
    def test_each_script_binds_the_names_it_declares_in_order(self, script):
        lines = script.source.splitlines()
        keys = next(line for line in lines if line.startswith("local ") and "KEYS[1]" in line)
        assert keys == f"local {', '.join(script.keys)} = {', '.join(f'KEYS[{i + 1}]' for i in range(len(script.keys)))}"
        if script.args:
            args = next(line for line in lines if line.startswith("local ") and "ARGV[1]" in line)
            assert args == f"local {', '.join(script.args)} = {', '.join(f'ARGV[{i + 1}]' for i in range(len(script.args)))}"

    def test_a_call_with_a_missing_or_unknown_name_is_refused(self):
        with pytest.raises(TypeError, match="tail.lua takes keys"):
            scripts.TAIL.command(rows_key="r", order="o")
        assert scripts.TAIL.command("id1", rows_key="r", order_key="o", tokens_key="k") == ("EVALSHA", scripts.TAIL.sha, 3, "r", "o", "k", "id1")


class TestTheRedisDriverKnowsItsRedisPy:
    def test_it_was_written_for_the_installed_redis_py(self):
        assert redis.__version__.rsplit(".", 1)[0] == redis_driver.WRITTEN_FOR, (
            f"redis-py {redis.__version__} is installed; memfilter.store.redis_driver reads the private parser of "
            f"{redis_driver.WRITTEN_FOR}.x: check it against the new release and move WRITTEN_FOR and pyproject's bound together"
        )

    def test_on_another_redis_py_it_refuses_to_load_naming_both_versions(self):
        code = "import redis; redis.__version__ = '9.0.0'; import memfilter.store.redis_driver"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 1
        assert f"written for redis-py {redis_driver.WRITTEN_FOR}.x and found 9.0.0" in done.stderr


class TestTheKafkaDriverKnowsItsAiokafka:
    def test_it_was_written_for_the_installed_aiokafka(self):
        assert aiokafka.__version__.rsplit(".", 1)[0] == kafka_driver.WRITTEN_FOR, (
            f"aiokafka {aiokafka.__version__} is installed; memfilter.runtime.kafka_driver mends the group coordinator of "
            f"{kafka_driver.WRITTEN_FOR}.x: check it against the new release (tests/system/test_kafka_driver.py) and move WRITTEN_FOR and pyproject's bound together"
        )

    def test_on_another_aiokafka_it_refuses_to_load_naming_both_versions(self):
        code = "import aiokafka; aiokafka.__version__ = '0.15.0'; import memfilter.runtime.kafka_driver"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 1
        assert f"written for aiokafka {kafka_driver.WRITTEN_FOR}.x and found 0.15.0" in done.stderr


class TestTheProcessKnowsItsMode:
    def test_the_signal_handlers_it_replaces_are_the_installed_modes(self):
        import importlib.metadata

        import mode

        from memfilter.runtime import process

        installed = importlib.metadata.version("mode-streaming")
        assert installed.rsplit(".", 1)[0] == process.WRITTEN_FOR, (
            f"mode-streaming {installed} is installed; memfilter.runtime.process replaces signal handlers of {process.WRITTEN_FOR}.x: "
            "check them against the new release and move WRITTEN_FOR and pyproject's bound together"
        )
        for private in ("_on_sigint", "_on_sigterm", "_schedule_shutdown"):
            assert callable(getattr(mode.Worker, private, None)), f"mode.Worker.{private} is gone"


class TestTheTestGroupsHold:
    GROUPED = """
import os, pytest
pytestmark = pytest.mark.xdist_group("stack")

@pytest.mark.parametrize("n", range(6))
def test_grouped(n):
    with open("workers.txt", "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""

    def test_tests_of_one_xdist_group_run_on_one_worker(self, tmp_path):
        """`deploy/test.sh` relies on `--dist loadgroup` to keep tests that kill a stack's brokers
        away from each other; pytest 9.2 silently stopped the grouping (pytest-xdist issue 1386)."""
        (tmp_path / "pytest.ini").write_text("[pytest]\n")
        (tmp_path / "test_grouped.py").write_text(self.GROUPED)
        (tmp_path / "test_free.py").write_text("def test_free_a(): pass\ndef test_free_b(): pass\n")
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-q"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        workers = set((tmp_path / "workers.txt").read_text().split())
        assert len(workers) == 1, f"one xdist_group ran on {sorted(workers)}: keep pytest and pytest-xdist at the versions in deploy/constraints.txt"


def test_no_two_test_modules_share_a_name():
    """The container tier collects every tier at once (`deploy/test.sh`), and pytest imports a
    test module by its name alone: two of one name in two tiers stop the collection."""
    names = [p.name for p in (Path(__file__).parents[1]).rglob("test_*.py") if "node_modules" not in p.parts]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
