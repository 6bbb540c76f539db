"""What every route module shares: strict request bodies and the per-request size limits."""

from pydantic import BaseModel, ConfigDict

from ..errors import TooLarge


class Strict(BaseModel):
    """A request body that refuses unknown fields (a typo is a 422, not silently ignored)."""

    model_config = ConfigDict(extra="forbid")


def too_many(field: str, n: int, limit: int) -> None:
    if n > limit:
        raise TooLarge(field, f"{n} items; at most {limit} per request")
