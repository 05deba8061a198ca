"""`python -m memfilter.schemas` writes one JSON Schema per topic value beside this file."""

import json
from pathlib import Path

from memfilter.schemas.wire import json_schemas

HERE = Path(__file__).parent


def schema_path(topic: str) -> Path:
    return HERE / f"{topic}.schema.json"


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    for topic, schema in json_schemas().items():
        schema_path(topic).write_text(render(schema))
        print(f"wrote {schema_path(topic)}")
