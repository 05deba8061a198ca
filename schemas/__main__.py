"""`python -m memfilter.schemas`: the topics' JSON Schemas, from the wire Structs.

`--check` says whether the files beside this module are the ones the Structs make (exit 1 if
not); `--write` writes them there, in a checkout (`python -m memfilter.schemas --write`);
`--out FOLDER` writes them to another folder. Without an option it prints what it would write.
"""

import argparse
import json
from pathlib import Path

from memfilter.schemas.wire import json_schemas

HERE = Path(__file__).parent


def schema_path(topic: str, folder: Path = HERE) -> Path:
    return folder / f"{topic}.schema.json"


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memfilter.schemas", description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true", help="exit 1 if the committed files are not what the Structs make")
    what.add_argument("--write", action="store_true", help="write the files beside this module (in a checkout)")
    what.add_argument("--out", type=Path, help="write the files to this folder")
    args = parser.parse_args(argv)
    schemas = {topic: render(schema) for topic, schema in json_schemas().items()}
    if args.check:
        stale = [str(schema_path(t)) for t, text in schemas.items() if not schema_path(t).exists() or schema_path(t).read_text() != text]
        for path in stale:
            print(f"{path} is stale: run python -m memfilter.schemas --write")
        return 1 if stale else 0
    if args.write or args.out:
        for topic, text in schemas.items():
            schema_path(topic, args.out or HERE).write_text(text)
            print(f"wrote {schema_path(topic, args.out or HERE)}")
        return 0
    for topic, text in schemas.items():
        print(f"# {schema_path(topic).name}\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
