"""Write the service's OpenAPI document: python -m nextstep.service.openapi [PATH] (default openapi/openapi.json)."""

import json
import sys
from pathlib import Path

from .app import create_app

DEFAULT_PATH = Path("openapi/openapi.json")


def document() -> dict:
    return create_app().openapi()


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
