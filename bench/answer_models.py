"""What validating the service's answers against their response models would cost (issue 57): the answers are
declared in the OpenAPI document (schemas.py) and encoded directly, as this measures. Per documented example of
every route: the encoding the service does (pydantic-core's to_json of the dict), and what FastAPI's response model
would add (the answer validated into its model, then dumped to JSON), in microseconds, median of rounds.

    python bench/answer_models.py [--rounds 7] [--n 2000]
"""

import argparse
import statistics
import time

from fastapi.routing import APIRoute
from pydantic_core import to_json

from nextstep import demo
from nextstep.service.app import create_app
from nextstep.service.settings import Settings


def per_call_us(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--n", type=int, default=2000, help="calls per round")
    args = parser.parse_args()
    app = create_app(Settings(artifacts_dir=demo.BUNDLED))
    rows = []
    routes = [(f"{sorted(r.methods)[0]} {r.path}", r) for r in app.routes
              if isinstance(r, APIRoute) and "model" in r.responses.get(200, {})]
    for name, route in sorted(routes, key=lambda nr: nr[0].split(" ")[1]):
        model = route.responses[200]["model"]
        example = route.responses[200]["content"]["application/json"]["example"]
        encode, validate = [], []
        for _ in range(args.rounds):  # interleaved: the machine's noise falls on both alike
            encode.append(per_call_us(lambda e=example: to_json(e), args.n))
            validate.append(per_call_us(lambda e=example, m=model: m.model_validate(e).model_dump_json(), args.n))
        rows.append((name, statistics.median(encode), statistics.median(validate)))
    print(f"{'route':58} {'to_json us':>10} {'validated us':>13} {'added us':>9}")
    for name, enc, val in rows:
        print(f"{name:58} {enc:10.1f} {val:13.1f} {val - enc:9.1f}")


if __name__ == "__main__":
    main()
