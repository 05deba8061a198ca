"""The history store's Lua scripts: `scripts/*.lua`, loaded as package resources.

Each script says at its top what it takes, by name: a `-- KEYS:` line and an `-- ARGV:` line,
and binds them to locals of those names. `Script.command(**named)` makes the EVALSHA command
from arguments given by the same names, so Python and Lua cannot disagree on an argument's
place; a missing or unknown name is a TypeError. Scripts take lists as one msgpack argument: a
batch of a few hundred requests names thousands of ids (rows go in as msgpack strings:
Redis's cmsgpack reads no `bin` values; they are UTF-8 JSON anyway).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str
    keys: tuple[str, ...]
    args: tuple[str, ...]  # empty for a script that takes any number of arguments (`command(*args)`)
    names: frozenset[str] = field(init=False)  # keys and arguments: checked on every call, made once

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset((*self.keys, *self.args)))

    @classmethod
    def load(cls, name: str) -> Script:
        source = files(__package__).joinpath(f"scripts/{name}.lua").read_text()
        declared = {line.split(":", 1)[0][3:]: line.split(":", 1)[1].split() for line in source.splitlines() if line.startswith(("-- KEYS:", "-- ARGV:"))}
        args = tuple(declared["ARGV"]) if declared["ARGV"][:1] != ["the"] else ()
        return cls(name, source, hashlib.sha1(source.encode()).hexdigest(), tuple(declared["KEYS"]), args)

    def command(self, *varargs: Any, **named: Any) -> tuple:
        """The EVALSHA command: keys and arguments by the names the script declares (and, for
        a script without named arguments, the arguments in `varargs`)."""
        if named.keys() != self.names:
            wrong = sorted(named.keys() ^ self.names)
            raise TypeError(f"{self.name}.lua takes keys {self.keys} and arguments {self.args}; not as given: {wrong}")
        return ("EVALSHA", self.sha, len(self.keys), *(named[k] for k in self.keys), *(named[a] for a in self.args), *varargs)


COMMIT = Script.load("commit")
APPLY = Script.load("apply")
TAIL = Script.load("tail")
ERASE = Script.load("erase")
EVICT = Script.load("evict")
RESTORE = Script.load("restore")
MEMORY = Script.load("memory")
ALL = (COMMIT, APPLY, TAIL, ERASE, EVICT, RESTORE, MEMORY)
